from served import NotInKvsplice


class ChatCompletionRequest(NotInKvsplice):
    pass


class BatchChatCompletionRequest(NotInKvsplice):
    pass
