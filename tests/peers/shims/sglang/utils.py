def encode_image_base64(*_args, **_kwargs):
    raise NotImplementedError("encode_image_base64 is SGLang's own helper")
