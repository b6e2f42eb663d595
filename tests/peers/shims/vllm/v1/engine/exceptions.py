from served import NotInKvsplice


class EngineDeadError(NotInKvsplice, Exception):
    pass
