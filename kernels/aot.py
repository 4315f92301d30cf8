"""Ahead-of-time kernels for a bundle: each chosen config compiled to cubins for the plan's GPUs, a manifest, a loader.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` needs no GPU (ptxas ships in the
triton wheel), so a CPU-only machine writes cubins for sm_90 and sm_100 alike. What goes into a bundle:

    kernels/
      manifest.json          one entry per (kernel, key, variant, arch): config, constexprs, signature, path, sha256
      kernel_table.json      the KernelTable the configs came from (measured on a GPU, or modeled by tile rules)
      src/*.py               the kernel sources: the JIT fallback, and what the table's source hashes name
      sm_90/*.cubin, *.json  one cubin per specialisation and its triton metadata (shared memory, warps, name)
      sm_100/...

A variant is one specialisation of a kernel: verification attention ships contiguous and paged
caches, each with and without split KV, plus the split combine; rejection sampling ships with and
without draft probabilities. Cubins are compiled assuming 16-byte aligned pointers and 16-divisible
strides where the shape makes them so (`aligned`); the loader checks that at launch.

`Launcher` runs a shipped cubin when the current GPU's architecture is the cubin's (read from its
ELF header, not only from the manifest) and the arguments meet the compiled assumptions; otherwise
the wrappers fall back to JIT compilation. Loading a cubin built for another architecture raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import torch

from specdec_tune import SpecdecError
from specdec_tune.kernels.buckets import next_pow2
from specdec_tune.kernels.tuning import KernelTable, ModelShapes, ServedShapes, call_shapes, source_hashes, tune_kernels
from specdec_tune.records import read_json, sha256_file, write_json

KERNEL_MANIFEST_SCHEMA_VERSION = 1
KERNEL_DIR = "kernels"
DEFAULT_ARCHS = ("sm_90", "sm_100")
DEFAULT_PAGE_SIZE = 16  # tokens per KV page (vLLM's default block size)
_EM_CUDA = 190  # ELF e_machine of a CUDA cubin

# jit function name -> module holding it (looked up at use, so a reloaded module's kernels are the ones run)
FUNCTIONS = {
    "verify_attention_kernel": "specdec_tune.kernels.verify_attention",
    "verify_attention_combine_kernel": "specdec_tune.kernels.verify_attention",
    "greedy_accept_kernel": "specdec_tune.kernels.acceptance",
    "rejection_sample_kernel": "specdec_tune.kernels.acceptance",
}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_POINTER_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


def capability_of(arch: str) -> int:
    """ "sm_90" -> 90."""
    if not arch.startswith("sm_") or not arch[3:].rstrip("a").isdigit():
        raise SpecdecError(f"unknown GPU architecture {arch!r}", "name it like sm_90 or sm_100")
    return int(arch[3:].rstrip("a"))


def current_arch() -> str | None:
    """This machine's GPU as sm_XY, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major * 10 + minor}"


def cubin_arch(cubin: bytes) -> str:
    """The SM a cubin was built for, from its ELF header (e_flags; CUDA ELF ABI 8 moved the SM to bits 8-15)."""
    if cubin[:4] != b"\x7fELF" or struct.unpack_from("<H", cubin, 18)[0] != _EM_CUDA:
        raise SpecdecError("file is not a CUDA cubin (ELF, e_machine 190)", "re-export the bundle")
    flags = struct.unpack_from("<I", cubin, 48)[0]
    sm = (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF
    return f"sm_{sm}"


# ----------------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
    """One specialisation of one kernel, compiled per arch."""

    function: str  # jit function name (FUNCTIONS)
    constexprs: dict
    signature: dict  # runtime argument -> triton type
    aligned: tuple[str, ...]  # arguments compiled as 16-byte aligned (pointers) or 16-divisible (ints)
    num_warps: int
    num_stages: int

    def ident(self) -> str:
        return json.dumps(
            [self.function, self.constexprs, self.signature, list(self.aligned), self.num_warps, self.num_stages],
            sort_keys=True,
        )


def _fn(function: str):
    return getattr(importlib.import_module(FUNCTIONS[function]), function)


def _jit_fn(function: str):
    """The kernel as a compilable JITFunction, also when this process runs kernels in the interpreter."""
    fn = _fn(function)
    return (
        getattr(_compilable_module(FUNCTIONS[function]), function) if type(fn).__name__ == "InterpretedFunction" else fn
    )


@contextlib.contextmanager
def _not_interpreting():
    """TRITON_INTERPRET unset for a while: triton.language builds interpreter values while it is set."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


@functools.cache
def _compilable_module(module_name: str):
    """A private copy of a kernel module decorated for compilation: the interpreter's stand-ins (the kernel and the
    jit functions it calls) cannot be compiled."""
    spec = importlib.util.spec_from_file_location(
        f"{module_name}__compilable", importlib.import_module(module_name).__file__
    )
    assert spec is not None and spec.loader is not None  # a module's own source file: a plain source loader
    module = importlib.util.module_from_spec(spec)
    with _not_interpreting():
        spec.loader.exec_module(module)
    return module


def _pointers(signature: dict) -> list[str]:
    return [name for name, ty in signature.items() if ty.startswith("*")]


def _attention_variants(key: dict, config: dict, dtype: torch.dtype, page_size: int) -> list[Variant]:
    from specdec_tune.kernels import verify_attention as va

    hd = key["head_dim"]
    block_d = max(16, next_pow2(hd))
    sig = va.signature(va.verify_attention_kernel, dtype)
    strides = [n for n in sig if n.startswith("stride_") and n != "stride_bt"] if hd % 16 == 0 else []
    out = []
    for paged in (False, True):
        for split in (False, True):
            constexprs = {
                "HEAD_DIM": hd,
                "BLOCK_D": block_d,
                "BLOCK_M": config["BLOCK_M"],
                "BLOCK_N": config["BLOCK_N"],
                "PAGE_SIZE": page_size if paged else 1,
                "PAGED": paged,
                "SPLIT_KV": split,
                "DOT_FP32": dtype == torch.float32,
            }
            out.append(
                Variant(
                    "verify_attention_kernel",
                    constexprs,
                    sig,
                    tuple(_pointers(sig) + strides),
                    config["num_warps"],
                    config["num_stages"],
                )
            )
    combine = va.signature(va.verify_attention_combine_kernel, dtype)
    out.append(
        Variant(
            "verify_attention_combine_kernel",
            {"HEAD_DIM": hd, "BLOCK_D": block_d, "BLOCK_S": va.MAX_KV_SPLITS},
            combine,
            tuple(_pointers(combine) + ([n for n in combine if n.startswith("stride_")] if hd % 16 == 0 else [])),
            4,
            1,
        )
    )
    return out


def _greedy_variants(key: dict, config: dict, dtype: torch.dtype, page_size: int) -> list[Variant]:
    from specdec_tune.kernels import acceptance

    sig = acceptance.signature(acceptance.greedy_accept_kernel, torch.float32)
    return [
        Variant(
            "greedy_accept_kernel",
            {"BLOCK_V": config["BLOCK_V"]},
            sig,
            tuple(_pointers(sig)),
            config["num_warps"],
            config["num_stages"],
        )
    ]


def _rejection_variants(key: dict, config: dict, dtype: torch.dtype, page_size: int) -> list[Variant]:
    from specdec_tune.kernels import acceptance

    sig = acceptance.signature(acceptance.rejection_sample_kernel, torch.float32)
    return [
        Variant(
            "rejection_sample_kernel",
            {"HAS_DRAFT_PROBS": probs, "BLOCK_V": config["BLOCK_V"]},
            sig,
            tuple(_pointers(sig)),
            config["num_warps"],
            config["num_stages"],
        )
        for probs in (False, True)
    ]


# kernel (table name) -> its shipped specialisations; logits stay fp32 (the model's head returns fp32)
VARIANTS = {
    "verify_attention": _attention_variants,
    "greedy_accept": _greedy_variants,
    "rejection_sample": _rejection_variants,
}


def _full_signature(fn, variant: Variant) -> tuple[dict, dict]:
    """Every parameter's triton type (constexprs as "constexpr") and the alignment attributes by position."""
    signature = {name: variant.signature.get(name, "constexpr") for name in fn.arg_names}
    missing = [n for n in fn.arg_names if n not in variant.signature and n not in variant.constexprs]
    if missing:
        raise SpecdecError(
            f"{variant.function}: no type or value for {missing}", "the kernel's signature() is out of date"
        )
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in variant.aligned}
    return signature, attrs


def compile_variant(variant: Variant, arch: str):
    """triton.compile of one variant for one GPU architecture; returns the CompiledKernel (cubin in .asm["cubin"]).

    Needs a process whose triton was not imported under TRITON_INTERPRET (its own library functions are then
    interpreter stand-ins); `compile_to` moves the work to a fresh process when this one interprets."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _fn(variant.function)
    signature, attrs = _full_signature(fn, variant)
    source = ASTSource(fn, signature, constexprs=dict(variant.constexprs), attrs=attrs)
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages, "enable_fp_fusion": True}
    try:
        return triton.compile(source, target=GPUTarget("cuda", capability_of(arch), 32), options=options)
    except Exception as e:  # noqa: BLE001 - ptxas and lowering errors: name the variant
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SpecdecError(
            f"compiling {variant.function} {variant.constexprs} for {arch} failed: {first[:200]}",
            "report this with the plan.json",
        ) from None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _die_with_parent() -> None:
    """The compiler process's preexec_fn: it is killed when the process that started it dies (Linux PR_SET_PDEATHSIG),
    so an export killed mid-way leaves nothing writing into its staging folder for the next export to clean up."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def compile_to(jobs: list[tuple[Variant, str]], out_dir: Path) -> list[dict]:
    """Compile every (variant, arch) and write its cubin and metadata under out_dir/kernels/<arch>/; one file record
    each.

    A process that interprets Triton compiles in a child process of its own (`compile_variant`); what the child wrote
    is kept under the cache, keyed by the jobs, triton's version and the kernel sources, so that the next export of
    the same shapes copies it instead of starting another compiler (seconds each on a small CPU)."""
    if not _interpreting():
        return [_write_binary(compile_variant(v, arch), v, arch, out_dir) for v, arch in jobs]
    import triton

    request = {"jobs": [[dataclasses.asdict(v), arch] for v, arch in jobs]}
    cached = (
        _compile_cache()
        / hashlib.sha256(
            json.dumps([request, triton.__version__, source_hashes()], sort_keys=True).encode()
        ).hexdigest()
    )
    if not (cached / "records.json").is_file():
        _compile_in_child(request | {"out_dir": str(cached / "out")})
        write_json(cached / "records.json", json.loads((cached / "out" / "records.json").read_text()))
    shutil.copytree(cached / "out" / KERNEL_DIR, out_dir / KERNEL_DIR, dirs_exist_ok=True)
    return read_json(cached / "records.json", "cached kernel records")


def _compile_cache() -> Path:
    """Where compiled kernels are kept between exports (the tool's cache; SPECDEC_TUNE_CACHE moves it)."""
    return Path(os.environ.get("SPECDEC_TUNE_CACHE", Path.home() / ".cache" / "specdec-tune")) / "kernels"


def _compile_in_child(request: dict) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "specdec_tune.kernels.aot"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        check=False,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise SpecdecError(
            f"the kernel compiler process failed: {lines[-1][:300]}",
            "run `specdec-tune export --debug` for the full error",
        )


def _compile_worker() -> None:
    """`python -m specdec_tune.kernels.aot`: compile the jobs given as JSON on stdin into its out_dir, and write their
    file records there (records.json)."""
    request = json.loads(sys.stdin.read())
    jobs = [(Variant(**{**v, "aligned": tuple(v["aligned"])}), arch) for v, arch in request["jobs"]]
    out_dir = Path(request["out_dir"])
    write_json(out_dir / "records.json", compile_to(jobs, out_dir))


# ------------------------------------------------------------------------------ bundle writer


def build_bundle_kernels(
    served: ServedShapes,
    out_dir: Path,
    archs: tuple[str, ...] = DEFAULT_ARCHS,
    *,
    shapes: ModelShapes,
    dtype: str = "bfloat16",
    page_size: int = DEFAULT_PAGE_SIZE,
    table: KernelTable | None = None,
    device: torch.device | None = None,
) -> dict:
    """Tune (on a CUDA `device`) or model the configs for the served shapes, compile them for `archs`, and write
    kernels/ under out_dir. Returns the kernel manifest (also written to kernels/manifest.json); its paths are
    relative to out_dir."""
    if dtype not in _DTYPES:
        raise SpecdecError(f"unknown kernel dtype {dtype!r}", f"use one of {', '.join(_DTYPES)}")
    for arch in archs:
        capability_of(arch)
    out_dir = Path(out_dir)
    root = out_dir / KERNEL_DIR
    root.mkdir(parents=True, exist_ok=True)
    calls = call_shapes(served, shapes)
    table = table or tune_kernels(calls, device=device, tile_rows=served.tile_rows)
    table.write(root / "kernel_table.json")
    sources = {}
    for name in source_hashes():
        rel = f"{KERNEL_DIR}/src/{name}.py"
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(__file__).resolve().parent / f"{name}.py", out_dir / rel)
        sources[rel] = sha256_file(out_dir / rel)

    uses = [
        (entry, variant, arch)
        for entry in table.entries
        for variant in VARIANTS[entry.kernel](entry.key, entry.config, _DTYPES[dtype], page_size)
        for arch in archs
    ]
    jobs = list(
        {(v.ident(), arch): (v, arch) for _, v, arch in uses}.values()
    )  # one compile per distinct specialisation
    records = dict(zip(((v.ident(), arch) for v, arch in jobs), compile_to(jobs, out_dir)))
    binaries = [
        {
            "kernel": entry.kernel,
            "key": entry.key,
            "config": entry.config,
            "config_source": entry.source,
            **records[(variant.ident(), arch)],
        }
        for entry, variant, arch in uses
    ]
    import triton

    manifest = {
        "schema_version": KERNEL_MANIFEST_SCHEMA_VERSION,
        "triton_version": triton.__version__,
        "archs": list(archs),
        "dtype": dtype,
        "page_size": page_size,
        "table": f"{KERNEL_DIR}/kernel_table.json",
        "table_sha256": sha256_file(root / "kernel_table.json"),
        "sources": sources,
        "binaries": binaries,
    }
    write_json(root / "manifest.json", manifest)
    return manifest


def _write_binary(kernel, variant: Variant, arch: str, out_dir: Path) -> dict:
    cubin = kernel.asm["cubin"]
    digest = hashlib.sha256(cubin).hexdigest()
    stem = f"{KERNEL_DIR}/{arch}/{variant.function}-{digest[:16]}"
    (out_dir / stem).parent.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.cubin").write_bytes(cubin)
    metadata = next(Path(p) for name, p in kernel.metadata_group.items() if name.endswith(".json"))
    shutil.copyfile(metadata, out_dir / f"{stem}.json")
    return {
        "function": variant.function,
        "arch": arch,
        "target": f"sm_{kernel.metadata.target.arch}",
        "constexprs": variant.constexprs,
        "signature": variant.signature,
        "aligned": list(variant.aligned),
        "num_warps": variant.num_warps,
        "num_stages": variant.num_stages,
        "path": f"{stem}.cubin",
        "sha256": digest,
        "bytes": len(cubin),
        "metadata_path": f"{stem}.json",
        "metadata_sha256": sha256_file(out_dir / f"{stem}.json"),
        "shared_bytes": kernel.metadata.shared,
        "name": kernel.metadata.name,
    }


# ------------------------------------------------------------------------------ validation


def _inside(bundle_dir: Path, rel: str) -> Path | None:
    path = bundle_dir / rel
    if (
        Path(rel).is_absolute()
        or ".." in Path(rel).parts
        or path.is_symlink()
        or not path.resolve().is_relative_to(bundle_dir.resolve())
    ):
        return None
    return path


def check_kernel_manifest(bundle_dir: Path, entries: dict) -> list[str]:
    """Errors in a bundle's kernel manifest (empty: it holds): every file inside the bundle and matching its hash,
    every cubin's ELF built for the arch its entry names, a binary for every tuned key, variant and arch."""
    bundle_dir = Path(bundle_dir)
    errors: list[str] = []
    if not isinstance(entries, dict) or entries.get("schema_version") != KERNEL_MANIFEST_SCHEMA_VERSION:
        return [f"kernel manifest is not schema version {KERNEL_MANIFEST_SCHEMA_VERSION}"]

    def file_ok(rel: str, digest: str, what: str) -> Path | None:
        path = _inside(bundle_dir, rel)
        if path is None:
            errors.append(f"{what} path {rel!r} leaves the bundle")
        elif not path.is_file():
            errors.append(f"{what} {rel} is missing")
        elif sha256_file(path) != digest:
            errors.append(f"{what} {rel} does not match its sha256")
        else:
            return path
        return None

    for rel, digest in entries.get("sources", {}).items():
        file_ok(rel, digest, "kernel source")
    table_path = file_ok(entries.get("table", ""), entries.get("table_sha256", ""), "kernel table")
    table = None
    if table_path is not None:
        try:
            table = KernelTable.read(table_path)
        except SpecdecError as e:
            errors.append(f"kernel table: {e}")
    if table is not None:
        shipped = {Path(rel).stem: digest for rel, digest in entries.get("sources", {}).items()}
        for name, digest in table.factors.get("sources", {}).items():
            if shipped.get(name) != digest:
                errors.append(f"kernel table was tuned on another {name}.py than the bundle ships")
    for b in entries.get("binaries", []):
        label = f"{b.get('function')} {b.get('arch')}"
        path = file_ok(b.get("path", ""), b.get("sha256", ""), f"cubin ({label})")
        file_ok(b.get("metadata_path", ""), b.get("metadata_sha256", ""), f"cubin metadata ({label})")
        if path is not None:
            try:
                built = cubin_arch(path.read_bytes())
                if capability_of(built) != capability_of(b["arch"]):
                    errors.append(f"{b['path']} is a {built} cubin but its entry says {b['arch']}")
            except SpecdecError as e:
                errors.append(f"{b['path']}: {e.message}")
        if table is not None:
            entry = table.lookup(b.get("kernel", ""), b.get("key", {}))
            if entry is None or entry.config != b.get("config"):
                errors.append(f"{label}: its config is not the kernel table's for key {b.get('key')}")
    if table is not None:
        have = {
            (b.get("kernel"), json.dumps(b.get("key"), sort_keys=True), b.get("arch"))
            for b in entries.get("binaries", [])
        }
        for row in table.entries:
            for arch in entries.get("archs", []):
                if (row.kernel, json.dumps(row.key, sort_keys=True), arch) not in have:
                    errors.append(f"no {arch} cubin for {row.kernel} key {row.key}")
        counts: dict[tuple, int] = {}
        for b in entries.get("binaries", []):
            k = (b.get("kernel"), json.dumps(b.get("key"), sort_keys=True), b.get("arch"))
            counts[k] = counts.get(k, 0) + 1
        dtype = _DTYPES.get(entries.get("dtype", ""), torch.bfloat16)
        for row in table.entries:
            want = len(VARIANTS[row.kernel](row.key, row.config, dtype, entries.get("page_size", DEFAULT_PAGE_SIZE)))
            for arch in entries.get("archs", []):
                got = counts.get((row.kernel, json.dumps(row.key, sort_keys=True), arch), 0)
                if got and got != want:
                    errors.append(f"{row.kernel} key {row.key} on {arch}: {got} cubins for {want} variants")
    return errors


def read_kernel_manifest(bundle_dir: Path) -> dict:
    return read_json(Path(bundle_dir) / KERNEL_DIR / "manifest.json", "kernel manifest")


# ---------------------------------------------------------------------------------- loader


def _arg_type(arg) -> str | None:
    if isinstance(arg, torch.Tensor):
        return _POINTER_TYPES.get(arg.dtype)
    if isinstance(arg, bool):
        return None
    if isinstance(arg, int):
        return "i32" if -(2**31) <= arg < 2**31 else "i64"
    if isinstance(arg, float):
        return "fp32"
    return None


class Launcher:
    """Runs shipped cubins for the kernel wrappers (their `launcher=` argument); `launch` answers False to fall back to
    JIT.

    Every decision is counted: `launched[function]` cubin launches, `fallbacks` the reasons for JIT runs.
    """

    def __init__(self, bundle_dir: Path, manifest: dict | None = None, device_arch: str | None = "auto") -> None:
        self.bundle_dir = Path(bundle_dir)
        self.manifest = manifest if manifest is not None else read_kernel_manifest(self.bundle_dir)
        self.device_arch = current_arch() if device_arch == "auto" else device_arch
        self.launched: dict[str, int] = {}
        self.fallbacks: list[str] = []
        self._loaded: dict[str, object] = {}

    def find(self, function: str, constexprs: dict, signature: dict, config: dict) -> dict | None:
        """The binary for this specialisation on this GPU, or None."""
        want = json.dumps(constexprs, sort_keys=True)
        for b in self.manifest.get("binaries", []):
            if (
                b["function"] == function
                and json.dumps(b["constexprs"], sort_keys=True) == want
                and b["signature"] == signature
                and b["num_warps"] == config["num_warps"]
                and b["num_stages"] == config["num_stages"]
                and self.device_arch is not None
                and capability_of(b["arch"]) == capability_of(self.device_arch)
            ):
                return b
        return None

    def load(self, entry: dict):
        """The shipped cubin as a launchable triton CompiledKernel; refuses one built for another arch or altered."""
        from triton.compiler import ASTSource, CompiledKernel

        if self.device_arch is None or capability_of(entry["arch"]) != capability_of(self.device_arch):
            raise SpecdecError(
                f"{entry['path']} is built for {entry['arch']}, this machine's GPU is {self.device_arch or 'absent'}",
                "export the bundle for this GPU's architecture, or run the kernels JIT-compiled",
            )
        if entry["path"] in self._loaded:
            return self._loaded[entry["path"]]
        path = _inside(self.bundle_dir, entry["path"])
        meta = _inside(self.bundle_dir, entry["metadata_path"])
        if path is None or meta is None or not path.is_file() or not meta.is_file():
            raise SpecdecError(f"cubin {entry['path']} is missing from the bundle", "re-export the bundle")
        cubin = path.read_bytes()
        if hashlib.sha256(cubin).hexdigest() != entry["sha256"] or sha256_file(meta) != entry["metadata_sha256"]:
            raise SpecdecError(f"cubin {entry['path']} does not match its sha256", "re-export the bundle")
        built = cubin_arch(cubin)
        if capability_of(built) != capability_of(self.device_arch):
            raise SpecdecError(
                f"{entry['path']} is a {built} cubin (its entry says {entry['arch']}); this GPU is {self.device_arch}",
                "re-export the bundle",
            )
        fn = _jit_fn(entry["function"])
        variant = Variant(
            entry["function"],
            entry["constexprs"],
            entry["signature"],
            tuple(entry["aligned"]),
            entry["num_warps"],
            entry["num_stages"],
        )
        signature, attrs = _full_signature(fn, variant)
        source = ASTSource(fn, signature, constexprs=dict(entry["constexprs"]), attrs=attrs)
        kernel = CompiledKernel(source, {path.name: str(path), meta.name: str(meta)}, entry["sha256"])
        self._loaded[entry["path"]] = kernel
        return kernel

    def launch(self, kernel, grid, args: tuple, constexprs: dict, config: dict) -> bool:
        """Launch the shipped cubin for this call and return True, or return False (the caller JITs)."""
        function = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
        names = [n for n in _fn(function).arg_names if n not in constexprs]
        signature = dict(zip(names, (_arg_type(a) for a in args)))
        if self.device_arch is None:
            return self._fallback(f"{function}: no CUDA device")
        if any(isinstance(a, torch.Tensor) and a.device.type != "cuda" for a in args):
            return self._fallback(f"{function}: tensors are not on the GPU")
        entry = self.find(function, constexprs, signature, config)
        if entry is None:
            return self._fallback(f"{function}: no {self.device_arch} cubin for {constexprs} {signature}")
        values = dict(zip(names, args))
        for name in entry["aligned"]:
            v = values[name]
            if (v.data_ptr() if isinstance(v, torch.Tensor) else v) % 16:
                return self._fallback(f"{function}: {name} is not 16-aligned as the cubin assumes")
        compiled = self.load(entry)
        ordered = [values[n] if n in values else constexprs[n] for n in _fn(function).arg_names]
        compiled[grid](*ordered)
        self.launched[function] = self.launched.get(function, 0) + 1
        return True

    def _fallback(self, reason: str) -> bool:
        self.fallbacks.append(reason)
        return False


if __name__ == "__main__":
    _compile_worker()
