class Counter:
    pass


class Vector:
    pass
