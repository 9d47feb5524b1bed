"""OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/embeddings over HTTP and
the ChatComplete / Complete / OpenAIEmbed RPCs (OpenAI JSON in json_body)."""
