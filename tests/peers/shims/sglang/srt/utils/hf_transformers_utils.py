from served import tokenizer


def get_tokenizer(*_args, **_kwargs):
    return tokenizer()
