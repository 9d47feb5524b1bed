"""Request and response shapes and their checks, no I/O: validation and bounds, JSON <-> proto
transcoding, n > 1 choices, logprob shapes, OpenAI and scoring bodies."""
