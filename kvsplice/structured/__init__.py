"""Structured outputs: constrain a reply to a JSON schema, a regex, a choice, a grammar or a tool call.

    spec.py      StructuredSpec (what the reply must match; pure data, the cache key)
    grammar.py   GrammarCache: spec -> xgrammar CompiledGrammar, compiled once (LRU)
    matcher.py   GrammarState (one request's place in its grammar) and the batch token bitmask
"""
