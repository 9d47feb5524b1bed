"""The embedded default model: a tiny random-weight Llama that meshlm builds for itself.

With no model path configured, every service (tokenizer, scheduler, detokenizer) and the tests
use this checkpoint. `ensure_default_model()` creates it deterministically, in the Hugging Face
layout, under `<cache>/models/meshlm-tiny-v1` and returns that path:

- `tokenizer.json`: byte-level BPE trained with `tokenizers` on the corpus below;
  `<|begin_of_text|>` is added as BOS when `add_special_tokens=True`.
- `tokenizer_config.json`, `special_tokens_map.json`: a ChatML chat template; the eos token is
  `<|im_end|>` (the end of an assistant turn), and `generation_config.json` / `config.json`
  list both `<|im_end|>` and `<|end_of_text|>` as eos ids.
- `config.json`, `model.safetensors`: a 4-layer `LlamaForCausalLM` (GQA, 8 query heads, 2 kv
  heads) with float32 weights from a fixed numpy seed, scaled so the logits are well spread
  (greedy decoding has few near-ties and does not collapse onto one token).

The cache root is the argument, else `$MESHLM_CACHE_DIR`, else `~/.cache/meshlm`. Several
processes may call this at once: each builds into its own temporary directory beside the
target and renames it into place atomically; the losers discard their copy.

Bump `_VERSION` whenever the bytes this module produces change.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEFAULT_MODEL_NAME = "meshlm-tiny"
_VERSION = 1
_DIR_NAME = f"{DEFAULT_MODEL_NAME}-v{_VERSION}"

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
EOS_TOKEN = IM_END_TOKEN

# ChatML. The template starts with the bos token (as Llama-3's does), so a rendered chat prompt
# is encoded with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_VOCAB_SIZE = 2048
_HIDDEN = 256
_INTERMEDIATE = 512
_LAYERS = 4
_HEADS = 8
_KV_HEADS = 2
_MAX_POSITIONS = 2048
_SEED = 20240601
# Standard deviations of the random weights. The final norm makes the hidden state RMS ~1, so
# the logits have std ~ _LM_HEAD_STD * sqrt(_HIDDEN) = 4: a few units, well spread.
_EMBED_STD = 1.0
_LM_HEAD_STD = 0.25
_NORM_JITTER = 0.1

_FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "model.safetensors",
)

CORPUS = """\
The harbor woke slowly. Gulls circled the masts while the fishermen coiled their ropes, and the
smell of salt and diesel drifted over the quay. Maria had run the little cafe by the water for
twenty-three years; she knew every boat by the sound of its engine. "Coffee, black, two sugars,"
she said before old Tomas could open his mouth. He laughed and sat down by the window.

Rain had fallen all night, and the streets were still shining when the first bus came around the
corner. A boy in a yellow coat jumped over a puddle, missed, and splashed his sister, who shrieked
and chased him halfway up the hill. Their mother called after them, but she was smiling.

In the mountains the snow came early that year. The shepherds brought the flocks down from the
high pastures in the second week of October, three weeks sooner than their grandfathers had. The
village held its autumn market anyway: cheese, honey, wool, apples, and bread baked in the stone
oven behind the church. Children ran between the stalls with sticky fingers and red cheeks.

A computer program is a list of instructions that a machine can follow. The instructions are
written in a programming language, such as Python, C, or Rust, and then translated into a form the
processor understands. Good programs are easy to read: their functions are short, their names say
what they mean, and their tests describe how they should behave. When a program fails, the error
message should tell the reader what went wrong and where to look.

A server listens on a network port and answers requests from clients. Each request carries a
method, a path, some headers, and sometimes a body. The server parses the request, does the work,
and sends back a response with a status code: 200 means success, 404 means the resource was not
found, and 500 means something broke inside the server. Timeouts, retries, and back-pressure keep a
busy system from falling over when the traffic grows faster than expected.

Language models read text as a sequence of tokens. A tokenizer splits the text into pieces, maps
each piece to an integer, and the model predicts the next integer, one step at a time. Sampling
with a temperature makes the output more varied; greedy decoding always picks the most likely
token. The attention layers let every position look back at the earlier positions, and a cache of
keys and values saves the work of recomputing them for each new token.

Photosynthesis turns light, water, and carbon dioxide into sugar and oxygen. It happens in the
chloroplasts of plant cells, where a green pigment called chlorophyll absorbs red and blue light
and reflects green. Forests, grasslands, and the tiny plankton of the ocean together produce most
of the oxygen that animals breathe. Without them the air would slowly change, and life would change
with it.

The recipe is simple. Melt two tablespoons of butter in a heavy pan over medium heat. Add one
chopped onion and a pinch of salt, and cook until soft and golden, about ten minutes. Stir in three
cloves of garlic, a teaspoon of smoked paprika, and a can of crushed tomatoes. Let it simmer for
twenty minutes, then taste, adjust the seasoning, and serve over rice or with fresh bread.

"Where are you going?" asked the fox.
"To the river," said the rabbit, "to find my brother. He went fishing yesterday and never came
home."
"Rabbits do not fish," said the fox.
"Mine does," said the rabbit, and she hopped away before the fox could think of an answer.

History is full of small accidents with large results. A letter delivered late, a storm that
scattered a fleet, a wrong turn taken by a driver in a crowded city: each of these changed the
course of nations. Historians argue about how much any single person can shape events, but they
agree that chance plays a larger role than most people like to admit.

Dear Sam,
Thank you for the books you sent last month. I have finished the one about the lighthouse keepers
and started the one about the desert expedition. The weather here has been strange, warm one day
and freezing the next, and the garden does not know what season it is. The tulips came up in
February! Please write soon and tell me how the new job is going.
With love,
Aunt Helen

The museum opens at nine o'clock on weekdays and at ten on weekends. Tickets cost twelve dollars
for adults and five for children under fourteen; students with a valid card pay half price. The
east wing holds paintings from the seventeenth and eighteenth centuries, and the west wing shows
sculpture, pottery, and old maps. Photography without flash is allowed in most rooms.

She counted the stars until she lost track, somewhere after four hundred. The night was clear and
cold, and the milky band of the galaxy stretched from one side of the sky to the other. Far away a
dog barked, and a train whistled twice as it crossed the bridge over the valley. She pulled the
blanket tighter and decided she would stay outside a little longer.

To measure the speed of a falling object, drop it from a known height and time its fall. Near the
surface of the Earth, objects accelerate at about 9.8 meters per second squared, so a stone
dropped from 20 meters reaches the ground in roughly two seconds. Air resistance slows light,
flat objects much more than heavy, round ones, which is why a feather drifts while a marble drops.

The team met every Monday morning to plan the week. First they reviewed what had shipped, then
what had slipped, and finally what was coming next. Questions were welcome; blame was not. When a
release went badly, they wrote down what happened, why it happened, and what they would change, and
they shared the notes with everyone in the company.

Weather report: cloudy in the morning with a chance of light showers, clearing by the afternoon.
Highs near 18 degrees, lows around 9. Winds from the west at 15 to 25 kilometers per hour. Tomorrow
looks sunny and warmer, and the weekend should be dry, although a storm may arrive on Monday night.

Questions and answers
Q: Why is the sky blue?
A: Sunlight scatters off the molecules of the air, and blue light scatters more than red light
because its wavelength is shorter. When you look at any part of the sky away from the sun, you see
that scattered blue light.
Q: Why are sunsets red?
A: At sunset the light travels through much more air to reach you, so most of the blue is
scattered away before it arrives, and the reds and oranges remain.

The old clock in the hall had stopped at a quarter past three, and nobody in the family remembered
when. Grandfather said it was the day the war ended; Grandmother said it was the winter the pipes
froze. The children believed it had simply grown tired of counting, and they liked it better that
way. Every guest who visited asked about it, and every guest heard a different story.

Numbers are everywhere: 1, 2, 3, 10, 42, 100, 256, 1024, 2048, 65536. A year has 365 days, or 366
in a leap year; a day has 24 hours; an hour has 60 minutes. Prices such as $3.99 or 12.50 euros,
dates such as 2024-06-01, and times such as 07:45 all look different, but a good tokenizer learns
to handle each of them.

He opened the door and stepped into the library. The air was quiet and smelled of paper and dust.
Long tables stood in rows under green lamps, and a woman behind the desk looked up, nodded, and went
back to her reading. He found the shelf he wanted, pulled down a heavy atlas, and spread it open on
the nearest table. The map of the northern islands was exactly as he remembered it.

Good writing is mostly rewriting. Say what you mean in plain words, cut what does not help the
reader, and read the result aloud. If a sentence makes you stumble, it will make your reader stumble
too. Short sentences are not always better, but they are rarely worse.

The river rises in the hills, runs through farmland and two small towns, and meets the sea in a wide
estuary full of birds. In spring the water is brown and fast with melted snow; in late summer it is
clear and slow, and you can see the fish resting in the shade under the willows. People have
crossed it by ferry, by ford, and by bridge for more than a thousand years.

The orchestra tuned for a long minute, oboe first, then strings, then brass. When the conductor
raised her baton the hall fell silent, and the first movement began with a single cello, low and
patient, joined one by one by violas, violins, clarinets, and finally the timpani. By the finale
half the audience was leaning forward in their seats, and the applause lasted almost ten minutes.

Astronauts aboard the station exercise for two hours every day, because muscles and bones weaken
quickly in microgravity. They sleep in small cabins, strapped into sleeping bags fixed to the wall,
and they eat tortillas instead of bread, since crumbs would float into delicate equipment. From
orbit they watch sixteen sunrises and sixteen sunsets in every twenty-four hours.

A nurse checked the patient's temperature, pulse, and blood pressure, then wrote the numbers on a
chart at the foot of the bed. The doctor arrived at noon, listened to the lungs, asked about
appetite and sleep, and adjusted the dosage of the antibiotic. "Drink plenty of water," she said,
"and walk around the corridor twice this afternoon if you feel strong enough."

The match was tied at one goal each with five minutes remaining. The visiting striker sprinted down
the left wing, cut inside past two defenders, and curled a shot toward the far post; the goalkeeper
stretched, fingertips brushing leather, and pushed it wide. From the corner kick a tall midfielder
rose above everyone and headed the winner into the net. The stadium exploded with noise.

Volcanoes form where molten rock, called magma, escapes through cracks in the crust. Some erupt
violently, hurling ash and pumice kilometers into the atmosphere; others pour out rivers of lava
that cool into black basalt. Fertile volcanic soil attracts farmers despite the danger, and
geologists monitor tremors, gases, and ground swelling to warn them before an eruption.

Autumn leaves, brittle and bright,
spin in the lantern's amber light;
the wind hums low, the chimney sighs,
and geese write letters across the skies.
"""


def default_cache_dir() -> Path:
    """`$MESHLM_CACHE_DIR` if set, else `~/.cache/meshlm`."""
    env = os.environ.get("MESHLM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshlm"


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the default model, building it first if it is not there.

    Safe to call from several processes at once (see `build_once`).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return build_once(root / "models" / _DIR_NAME, build_default_model, _is_complete)


def build_once(target: Path, build: Callable[[Path], None],
               is_complete: Callable[[Path], bool]) -> Path:
    """`target`, built by `build(tmp_dir)` first unless `is_complete(target)`.

    The build goes into a private temporary directory renamed into place, so readers only
    ever see a complete directory and concurrent builders do not clash (the loser of the
    rename keeps the winner's). An incomplete target (damaged, or made by hand) is moved
    aside and rebuilt.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        _discard(target, target.parent / f".{target.name}.broken-{uuid.uuid4().hex}")
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_default_model(out_dir: str | Path) -> None:
    """Write every file of the default model into `out_dir` (which must exist)."""
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: _token_id(tokenizer, tok) for tok in SPECIAL_TOKENS}
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_ids = [ids[IM_END_TOKEN], ids[END_OF_TEXT_TOKEN]]

    _write_json(out / "config.json", _model_config(vocab_size, ids[BOS_TOKEN], eos_ids))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": eos_ids, "pad_token_id": ids[PAD_TOKEN]},
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer))
    save_file(_weights(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer on CORPUS (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"default model: token {token!r} missing from the vocabulary")
    return int(token_id)


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    added = {
        str(_token_id(tokenizer, tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": _MAX_POSITIONS,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _model_config(vocab_size: int, bos_id: int, eos_ids: list[int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "head_dim": _HIDDEN // _HEADS,
        "hidden_act": "silu",
        "hidden_size": _HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": _INTERMEDIATE,
        "max_position_embeddings": _MAX_POSITIONS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": _HEADS,
        "num_hidden_layers": _LAYERS,
        "num_key_value_heads": _KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _weights(vocab_size: int) -> dict[str, np.ndarray]:
    """HF Llama parameter names -> float32 arrays ([out, in] for linear layers)."""
    rng = np.random.default_rng(_SEED)
    head_dim = _HIDDEN // _HEADS
    kv_dim = _KV_HEADS * head_dim

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return normal((out_features, in_features), in_features**-0.5)

    def norm() -> np.ndarray:
        return (1.0 + normal((_HIDDEN,), _NORM_JITTER)).astype(np.float32)

    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal((vocab_size, _HIDDEN), _EMBED_STD)
    }
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm()
        tensors[p + "self_attn.q_proj.weight"] = linear(_HIDDEN, _HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_dim, _HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_dim, _HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = linear(_HIDDEN, _HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = norm()
        tensors[p + "mlp.gate_proj.weight"] = linear(_INTERMEDIATE, _HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = linear(_INTERMEDIATE, _HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = linear(_HIDDEN, _INTERMEDIATE)
    tensors["model.norm.weight"] = norm()
    tensors["lm_head.weight"] = normal((vocab_size, _HIDDEN), _LM_HEAD_STD)
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _FILES)


def _discard(path: Path, aside: Path) -> None:
    try:
        os.rename(path, aside)
    except OSError:
        return  # someone else moved or replaced it first
    shutil.rmtree(aside, ignore_errors=True)
