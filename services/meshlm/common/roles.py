"""The mesh's roles and the mesh (mutual TLS) port each listens on by default."""

from __future__ import annotations

MESH_PORTS = {"gateway": 50050, "tokenizer": 50051, "scheduler": 50052, "detokenizer": 50053}
