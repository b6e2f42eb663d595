from served import NotInKvsplice


class ChatCompletionRequest(NotInKvsplice):
    pass
