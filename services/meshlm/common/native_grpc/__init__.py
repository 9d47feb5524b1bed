"""A gRPC server on asyncio's event loop, for the gateway's public port (`server.py`)."""
