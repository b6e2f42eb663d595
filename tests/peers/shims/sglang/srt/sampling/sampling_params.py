"""SGLang's own regex length helper (its test is deselected: it tests SGLang's code, not its HTTP API)."""

MAX_LEN = 2**30


def get_max_seq_length(regex_str: str) -> int:
    raise NotImplementedError("get_max_seq_length is SGLang's own code, not part of kvsplice's HTTP API")
