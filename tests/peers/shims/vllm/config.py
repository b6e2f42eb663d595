"""`ModelConfig(model=...).get_vocab_size()`: the served model's vocabulary size, whatever model is named."""

from served import vocab_size


class ModelConfig:
    def __init__(self, model: str, **_ignored) -> None:
        self.model = model

    def get_vocab_size(self) -> int:
        return vocab_size()
