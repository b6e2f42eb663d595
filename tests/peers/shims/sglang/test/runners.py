"""SGLang's rerank fixtures: used only by its /v1/rerank tests, which are deselected."""

TEST_RERANK_QUERY_DOCS: list = []
