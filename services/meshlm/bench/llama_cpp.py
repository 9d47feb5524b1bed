"""llama.cpp's `llama-server` as a benchmark peer, built from a registry source distribution.

`ensure_llama_server()` downloads the `llama-cpp-python` sdist with pip (the one network step,
at set-up), unpacks it and builds only the `llama-server` target of its vendored llama.cpp tree
with CMake: CPU only, Release, native CPU flags, static libraries (so the binary survives the
rename into place), no curl, tests or examples, so the build itself fetches nothing. The result
is cached under `<cache>/llama.cpp-<version>/` and built once (`build_once`).

`ensure_gguf()` converts a Hugging Face checkpoint to GGUF f32 (or bf16) with the vendored
`convert_hf_to_gguf.py` and its vendored `gguf-py`, cached inside the checkpoint directory.
The converter names a BPE pre-tokenizer by a hash of the token ids it gives one fixed text,
so it knows only the vocabularies of published models and refuses the bench checkpoint's own
2048-token vocabulary ("BPE pre-tokenizer was not recognized"), although its pre-tokenizer is
GPT-2's (ByteLevel with the GPT-2 regex, no prefix space, no normalizer). For such a tokenizer
only (`is_gpt2_pretokenizer`), the converter runs with an unknown hash mapped to "gpt-2";
`LlamaCppServer.check_tokenizer` then compares llama.cpp's token ids with the tokenizer's.

`LlamaCppServer` runs the binary on the GGUF file as a benchmark peer; `llama_cpp_stream` is
`completions_stream` with llama.cpp's `ignore_eos`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx

from meshlm.bench.raw_http import SsePool
from meshlm.bench.serving import ServerProcess, StreamStats, completions_stream
from meshlm.bench.workload import BenchRequest
from meshlm.common.default_model import build_once, default_cache_dir

VERSION = "0.3.36"  # llama-cpp-python, whose sdist carries the llama.cpp tree
_PACKAGE = "llama-cpp-python"
_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DBUILD_SHARED_LIBS=OFF",
)


def llama_cpp_dir(cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / f"llama.cpp-{VERSION}"


def ensure_llama_server(cache_dir: str | Path | None = None, jobs: int = 2) -> Path:
    """The `llama-server` binary, built first (several minutes) if it is not cached."""
    target = build_once(llama_cpp_dir(cache_dir), lambda tmp: build_llama_server(tmp, jobs),
                        _is_complete)
    return target / "bin" / "llama-server"


def build_llama_server(out_dir: Path, jobs: int = 2) -> None:
    """Download and unpack the sdist into `out_dir/src`, build `llama-server` into
    `out_dir/bin`, keep the vendored converter and gguf-py in `out_dir/converter`."""
    sdist = _download_sdist(out_dir / "dist")
    with tarfile.open(sdist) as tar:
        tar.extractall(out_dir / "src", filter="data")
    source = vendored_tree(out_dir)
    build = out_dir / "build"
    start = time.monotonic()
    _run(["cmake", "-S", str(source), "-B", str(build), *_CMAKE_FLAGS])
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)])
    seconds = time.monotonic() - start
    (out_dir / "bin").mkdir()
    shutil.copy2(build / "bin" / "llama-server", out_dir / "bin" / "llama-server")
    shutil.rmtree(build)  # objects: hundreds of MB, not needed once linked
    shutil.rmtree(out_dir / "dist")
    _keep_converter_only(out_dir)
    (out_dir / ".complete").write_text(f"{_PACKAGE} {VERSION}: built in {seconds:.0f}s\n")


_CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def _keep_converter_only(out_dir: Path) -> None:
    """Move the vendored converter and its gguf-py to `out_dir/converter`, then delete the
    unpacked sources (~200 MB)."""
    tree, keep = vendored_tree(out_dir), converter_dir(out_dir)
    keep.mkdir()
    for name in _CONVERTER_FILES:
        shutil.move(tree / name, keep / name)
    shutil.rmtree(out_dir / "src")


def converter_dir(llama_dir: Path) -> Path:
    """Where the cached build keeps `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`."""
    return llama_dir / "converter"


def vendored_tree(llama_dir: Path) -> Path:
    """The llama.cpp source tree inside the unpacked sdist."""
    return llama_dir / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def ensure_gguf(checkpoint_dir: str | Path, cache_dir: str | Path | None = None,
                outtype: str = "f32") -> Path:
    """`<checkpoint>/gguf/model-f32.gguf` (`outtype` f32) or `<checkpoint>/gguf-bf16/
    model-bf16.gguf`, converted first if it is missing."""
    checkpoint = Path(checkpoint_dir)
    name = f"model-{outtype}.gguf"
    target = build_once(checkpoint / ("gguf" if outtype == "f32" else f"gguf-{outtype}"),
                        lambda tmp: convert_to_gguf(checkpoint, tmp / name, cache_dir, outtype),
                        lambda path: (path / name).is_file())
    return target / name


GGUF_TYPES = ("f32", "bf16")  # the weight types the benchmark converts to

# Runs the vendored converter with the GPT-2 pre-tokenizer assumed where its hash is unknown.
_CONVERT = """\
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = pre
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_to_gguf(checkpoint: Path, out_file: Path, cache_dir: str | Path | None = None,
                    outtype: str = "f32") -> None:
    """Write `checkpoint` as a GGUF file of `outtype` weights with llama.cpp's converter."""
    ensure_llama_server(cache_dir)
    tree = converter_dir(llama_cpp_dir(cache_dir))
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    converter = ["-c", _CONVERT, str(tree)]
    if not is_gpt2_pretokenizer(tokenizer):  # the converter's own verdict, unpatched
        converter = [str(tree / "convert_hf_to_gguf.py")]
    _run([sys.executable, *converter, "--outtype", outtype, "--outfile", str(out_file),
          str(checkpoint)])


def is_gpt2_pretokenizer(tokenizer: dict[str, object]) -> bool:
    """Whether a tokenizer.json is byte-level BPE split as GPT-2 splits: a ByteLevel
    pre-tokenizer with its (GPT-2) regex and no prefix space, and no normalizer."""
    model, pre = tokenizer.get("model"), tokenizer.get("pre_tokenizer")
    return (isinstance(model, dict) and model.get("type") == "BPE"
            and tokenizer.get("normalizer") is None
            and isinstance(pre, dict) and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) is True and not pre.get("add_prefix_space", True))


class LlamaCppServer(ServerProcess):
    """`llama-server` on 127.0.0.1: `slots` parallel sequences of up to `ctx` tokens each in one
    continuous batch, `threads` CPU threads, no web UI.

    Drive it without HTTP keep-alive (`run_http(..., keepalive=False)`): at 16 streams on 2
    CPUs, requests on reused connections were dropped unanswered ("Server disconnected without
    sending a response") once the first streams ended; a fresh loopback connection per request
    costs well under a millisecond."""

    name = "llama-server"

    def __init__(self, binary: Path, gguf: Path, log_path: Path, threads: int = 2,
                 slots: int = 16, ctx: int = 1024, startup_timeout: float = 120.0,
                 cache_type: str | None = None) -> None:
        super().__init__(log_path, startup_timeout)
        self.binary, self.gguf = binary, gguf
        self.threads, self.slots, self.ctx = threads, slots, ctx
        self.cache_type = cache_type  # the KV cache's type (f16, f32); None: its default, f16

    def args(self) -> list[str]:
        cache = (["--cache-type-k", self.cache_type, "--cache-type-v", self.cache_type]
                 if self.cache_type else [])
        return [str(self.binary), "-m", str(self.gguf), "-t", str(self.threads),
                "-np", str(self.slots), "-c", str(self.slots * self.ctx), *cache, "--no-webui",
                "--host", "127.0.0.1", "--port", str(self.port)]

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's token ids for `text`, without BOS."""
        resp = httpx.post(f"{self.base_url}/tokenize",
                          json={"content": text, "add_special": False, "parse_special": False},
                          timeout=30.0)
        resp.raise_for_status()
        return [int(t) for t in resp.json()["tokens"]]

    def check_tokenizer(self, tokenizer_file: Path, texts: list[str]) -> list[str]:
        """Texts whose llama.cpp token ids differ from the tokenizer's (no special tokens),
        each with both id lists; empty when all agree."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        mismatches = []
        for text in texts:
            ours, theirs = tok.encode(text, add_special_tokens=False).ids, self.tokenize(text)
            if ours != theirs:
                mismatches.append(f"{text[:40]!r}: tokenizer {ours[:12]} llama.cpp {theirs[:12]}")
        return mismatches


async def llama_cpp_stream(client: SsePool, request: BenchRequest) -> StreamStats:
    """One streamed /v1/completions request to llama-server, greedy, EOS ignored."""
    return await completions_stream(client, request, {"ignore_eos": True, "temperature": 0})


def _download_sdist(dest: Path) -> Path:
    dest.mkdir(parents=True)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
          "--no-deps", f"{_PACKAGE}=={VERSION}", "-d", str(dest)])
    found = sorted(dest.glob("*.tar.gz"))
    if len(found) != 1:
        raise RuntimeError(f"expected one sdist in {dest}, found {[p.name for p in found]}")
    return found[0]


def _run(args: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} {args[1] if len(args) > 1 else ''} failed "
                           f"({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")


def _is_complete(path: Path) -> bool:
    return ((path / ".complete").is_file() and (path / "bin" / "llama-server").is_file()
            and (converter_dir(path) / "convert_hf_to_gguf.py").is_file())


if __name__ == "__main__":
    t0 = time.monotonic()
    binary = ensure_llama_server()
    print(f"{binary} ({binary.stat().st_size / 2**20:.1f} MiB) in {time.monotonic() - t0:.0f}s")
    print((binary.parent.parent / ".complete").read_text().strip())
