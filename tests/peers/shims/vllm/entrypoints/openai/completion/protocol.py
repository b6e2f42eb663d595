from served import NotInKvsplice


class CompletionRequest(NotInKvsplice):
    pass
