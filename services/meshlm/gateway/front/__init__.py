"""The transports: the gRPC servicer, the HTTP app (transcoded RPCs, SGLang-native and OpenAI
routes), API keys, body limits, client disconnects and memory reclaim after big requests."""
