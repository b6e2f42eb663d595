from served import NotInKvsplice


class VLLMValidationError(NotInKvsplice, ValueError):
    pass
