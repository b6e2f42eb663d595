"""`kill_process_tree` stops nothing (the server is the session's); `is_npu` is False."""


def kill_process_tree(pid, *args, **kwargs) -> None:
    return None


def is_npu() -> bool:
    return False
