"""llama.cpp peer's pure parts: the GPT-2 pre-tokenizer check and the server command line."""

from __future__ import annotations

from pathlib import Path

from meshlm.bench.llama_cpp import LlamaCppServer, is_gpt2_pretokenizer, vendored_tree

GPT2 = {
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": True},
    "model": {"type": "BPE", "vocab": {}, "merges": []},
}


def test_gpt2_byte_level_is_recognized() -> None:
    assert is_gpt2_pretokenizer(GPT2)


def test_other_pretokenizers_are_not() -> None:
    assert not is_gpt2_pretokenizer({**GPT2, "pre_tokenizer": {**GPT2["pre_tokenizer"],  # type: ignore[dict-item]
                                                              "add_prefix_space": True}})
    assert not is_gpt2_pretokenizer({**GPT2, "pre_tokenizer": {"type": "ByteLevel",
                                                              "add_prefix_space": False,
                                                              "use_regex": False}})
    assert not is_gpt2_pretokenizer({**GPT2, "pre_tokenizer": {"type": "Sequence",
                                                              "pretokenizers": []}})
    assert not is_gpt2_pretokenizer({**GPT2, "normalizer": {"type": "NFC"}})
    assert not is_gpt2_pretokenizer({**GPT2, "model": {"type": "Unigram"}})
    # tokenizers' ByteLevel default is add_prefix_space true
    assert not is_gpt2_pretokenizer({**GPT2, "pre_tokenizer": {"type": "ByteLevel"}})


def test_server_command_line() -> None:
    server = LlamaCppServer(Path("/b/llama-server"), Path("/m.gguf"), Path("/log"),
                            threads=2, slots=16, ctx=512)
    server.port = 4321
    args = server.args()
    assert args[0] == "/b/llama-server"

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert (value("-m"), value("-t"), value("-np")) == ("/m.gguf", "2", "16")
    assert value("-c") == str(16 * 512)  # one context of ctx tokens per slot
    assert (value("--host"), value("--port")) == ("127.0.0.1", "4321")
    assert "--cache-type-k" not in args  # its default KV cache, float16
    server.cache_type = "f32"
    args = server.args()
    assert (value("--cache-type-k"), value("--cache-type-v")) == ("f32", "f32")


def test_vendored_tree_layout() -> None:
    assert vendored_tree(Path("/c/llama.cpp-0.3.36")) == Path(
        "/c/llama.cpp-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp")


def test_report_peers_ratios() -> None:
    from meshlm.bench.engine import Result
    from meshlm.bench.peers import report_peers

    mesh = Result("meshlm", 200, 1.0, [0.1, 0.1], [0.01, 0.01])
    llama = Result("llama.cpp", 100, 1.0, [0.2, 0.2], [0.02, 0.02])
    lines = report_peers({"llama.cpp": llama, "serve": None, "mesh": mesh}, 16)
    assert "ITL p50 ms" in lines[0] and len(lines) == 5
    assert "meshlm / llama.cpp: throughput 2.00x, TTFT p50 0.50x, ITL p50 0.50x" in lines
    assert lines[-1].startswith("meshlm / transformers serve: throughput n/a")


def test_build_keeps_only_the_converter(tmp_path: Path) -> None:
    from meshlm.bench.llama_cpp import _keep_converter_only, converter_dir

    tree = vendored_tree(tmp_path)
    for name in ("convert_hf_to_gguf.py", "conversion/base.py", "gguf-py/gguf/__init__.py",
                 "ggml/src/ggml.c"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(name)
    _keep_converter_only(tmp_path)
    assert not (tmp_path / "src").exists()
    conv = converter_dir(tmp_path)
    assert sorted(p.name for p in conv.iterdir()) == [
        "conversion", "convert_hf_to_gguf.py", "gguf-py"]
    assert (conv / "conversion" / "base.py").read_text() == "conversion/base.py"
