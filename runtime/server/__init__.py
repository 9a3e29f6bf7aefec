"""`edgeprefill serve`: the embedding API behind the OpenAI HTTP interface."""
