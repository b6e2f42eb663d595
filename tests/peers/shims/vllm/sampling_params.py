from served import NotInKvsplice


class SamplingParams(NotInKvsplice):
    pass
