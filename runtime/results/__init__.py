"""The result files a run writes as it goes (requests.jsonl, iterations.jsonl) and its
summary.json: one writer for `run`, the embedding API and the server."""
