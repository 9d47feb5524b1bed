"""What each RPC family does, whatever the transport: generation (admission, routing, the
request's lifecycle), info, admin, pause, profile, weights, the OpenAI and scoring calls."""
