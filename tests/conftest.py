"""Every test: this folder is on sys.path (pytest puts a conftest's folder there), so unit and
e2e tests share the modules here (`sglang_upstream`: SGLang's proto as upstream has it)."""
