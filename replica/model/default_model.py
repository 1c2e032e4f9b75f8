"""The default model: a tiny Llama checkpoint generated deterministically into a Hugging Face folder.

It exists so that the whole cluster runs (and is tested) without downloading anything: the same
seed always yields byte-identical files, in the exact format real checkpoints use, so the loader,
tokenizer and engine paths exercised are the production ones. Its weights are random; it speaks
nonsense, fluently and at length (the special tokens' LM-head rows are zero, so greedy decoding
never picks EOS and tests get long outputs).

Folder contents: ``config.json`` (LlamaForCausalLM: hidden 256, 4 layers, 8 heads, 4 KV heads,
intermediate 688, max positions 8192, float32), ``generation_config.json``, ``model.safetensors``,
``tokenizer.json`` (byte-level BPE trained with ``tokenizers`` on the built-in text below, plus
Llama-3-style special tokens; a post-processor adds BOS), ``tokenizer_config.json`` (with a
Llama-3-style chat template). It loads unchanged in transformers' ``LlamaForCausalLM`` and
``AutoTokenizer``. ``weights=False`` writes every file but ``model.safetensors``, without torch:
what a router needs (it tokenizes and hashes, never runs the model), e.g. in the router image.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvroute.model_folder import ModelLoadError
from kvroute.prompt import DEFAULT_MODEL_DIRNAME as DEFAULT_MODEL_DIRNAME

if TYPE_CHECKING:
    import torch

# DEFAULT_MODEL_DIRNAME is the contract's (kvroute.prompt): the router finds the default model by it.
DEFAULT_SEED = 0

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN)

HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 688
NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 4
# 8192 holds every prompt of the bundled trace with 32 tokens per hash id, output included: the
# workload the peer routers were measured on (docs/results.md).
# RoPE needs nothing more: its cos/sin table is computed on demand up to the longest sequence.
MAX_POSITION_EMBEDDINGS = 8192
# config.json keys whose value changed between revisions of the generated model (4096 positions
# until 2026-12-02): a folder whose config differs from today's only there is regenerated.
_REVISED_CONFIG_KEYS = frozenset({"max_position_embeddings"})
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5
INIT_STD = 0.02
# Embeddings larger than the 0.02 of the rest, so that the current token and the attention
# summary of the history weigh about the same in the residual stream: greedy decoding then wanders
# through the vocabulary, history-dependent, instead of settling on one token (as it does at 0.02).
EMBED_STD = 0.3
BPE_VOCAB_TARGET = 256 + 512  # byte alphabet + at most 512 merges (the text yields a few hundred)

# Llama 3's layout: BOS once, then per message a role header, the trimmed content and <|eot_id|>.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Conversation roles must be system, user or assistant, got ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# The BPE training text: plain English prose, written for this project.
TRAINING_TEXT = """\
The harbour town woke before the sun. Fishing boats slid out past the breakwater while the baker
on the corner pulled the first loaves from the oven, and the smell of bread drifted down to the
water. An old woman walked her dog along the sea wall, as she did every morning, and counted the
gulls on the posts. There were seven today, which she said was a good sign.

In the library on the hill, a young student opened a book about the history of the town. The
first houses had been built of grey stone from the quarry, and the streets still followed the
paths that the carts had taken long ago. Every page held a small story: a storm that flooded the
market, a ship that came home after three years at sea, a school that opened with only nine
children and a single teacher who taught them everything she knew.

A computer answers a question by reading the words one at a time. Each word becomes a number,
and the numbers pass through many layers of simple arithmetic. What it has already read is kept
in memory, so that it does not need to read the same beginning twice. When many people ask
questions that start the same way, a clever router sends them to the machine that remembers that
beginning, and the answer comes back sooner. Small blocks of memory are shared, counted, and
returned when nobody needs them any more.

The weather turned in the afternoon. Clouds rolled in from the west, the wind picked up, and the
boats came back early with their nets half full. People hurried home with their collars turned
up against the rain. In the kitchen of a small house by the harbour, a family sat down to eat
soup and bread, and talked about the day: who had been seen at the market, what the teacher had
said, and whether the storm would pass before the morning.

Good writing is clear and direct. Say what you mean in as few words as you can, and choose the
plain word over the fancy one. Read your sentences aloud; if you run out of breath, the sentence
is too long. Cut every word that does not earn its place, and then read it again tomorrow, when
you have forgotten what you meant to say and can see only what you wrote.

At night the lighthouse turned its slow beam across the water, once every ten seconds, as it had
for more than a hundred years. The keeper climbed the stairs at dusk to light the lamp, wound the
clock that turned the lens, and wrote in the log the time, the wind, and the state of the sea.
Then he sat by the window with a cup of tea and watched the lights of the ships go by.
"""


def ensure_default_model(path: str | Path, seed: int = DEFAULT_SEED, *, weights: bool = True) -> Path:
    """Return ``path``, generating the default model there first unless a model is already there.

    A folder that already has ``config.json`` is taken as is, unless it holds an earlier revision
    of the default model (a config that differs from today's only in ``_REVISED_CONFIG_KEYS``),
    which is rewritten in place, file by file as below. Otherwise the files are written to a
    temporary sibling folder and renamed into place, so readers never see half a model; when
    ``path`` is an existing directory (say, an empty volume mount, which can't be renamed over) the
    files are written into it one by one, each atomically, ``config.json`` last.

    ``weights=False``: the same files without ``model.safetensors`` (no torch imported), for a
    router's own folder; never give such a folder to a replica.

    Raises:
        ModelLoadError: ``path`` is a file, or a directory that holds other files but no
            ``config.json``.
    """
    path = Path(path)
    if (path / "config.json").is_file() and not _earlier_revision(path / "config.json"):
        return path
    if path.exists() and not path.is_dir():
        raise ModelLoadError(f"default model path {path} exists and is not a directory", path=path)
    files = build_default_model_files(seed, weights=weights)
    if path.is_dir():
        others = sorted(p.name for p in path.iterdir() if p.name not in files and not p.name.startswith("."))
        if others:
            raise ModelLoadError(
                f"{path} has no config.json but holds other files ({', '.join(others[:5])}); "
                "refusing to write the default model there",
                path=path,
            )
        for name in sorted(files, key=lambda n: n == "config.json"):  # config.json marks completeness
            _write_atomically(path / name, files[name])
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        try:
            os.rename(tmp, path)
        except OSError:
            if (path / "config.json").is_file():  # another process finished first
                return path
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_default_model_files(seed: int = DEFAULT_SEED, *, weights: bool = True) -> dict[str, bytes]:
    """The default model's files, name -> content; identical bytes for identical ``seed``
    (``weights=False``: all but ``model.safetensors``, and torch is not imported).

    Randomness comes only from a private ``torch.Generator`` seeded with ``seed`` (the global
    torch RNG is neither read nor reseeded); BPE training is deterministic.
    """
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = _config(tokenizer)
    generation_config = {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[EOT_TOKEN]],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }
    files = {
        "config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(generation_config),
        "tokenizer.json": tokenizer.to_str(pretty=True).encode("utf-8"),
        "tokenizer_config.json": _json_bytes(tokenizer_config),
    }
    if weights:
        from safetensors.torch import save as save_safetensors

        tensors = _random_weights(vocab_size, [ids[t] for t in SPECIAL_TOKENS], seed)
        files["model.safetensors"] = save_safetensors(tensors, metadata={"format": "pt"})
    return dict(sorted(files.items()))


def _config(tokenizer: Tokenizer) -> dict[str, Any]:
    """``config.json``'s content for the default model with ``tokenizer`` (``build_tokenizer``)."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HIDDEN_SIZE // NUM_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "initializer_range": INIT_STD,
        "torch_dtype": "float32",
    }


def _earlier_revision(config_path: Path) -> bool:
    """Whether ``config_path`` holds the config of an earlier revision of the default model."""
    try:
        found = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    want = _config(build_tokenizer())
    if not isinstance(found, dict) or found == want:
        return False
    return {k for k in found.keys() | want.keys() if found.get(k) != want.get(k)} <= _REVISED_CONFIG_KEYS


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE: the 256 byte symbols, merges learnt from ``TRAINING_TEXT`` (GPT-2 style
    pre-tokenisation), the five special tokens appended after them, and BOS added on encode."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_TARGET,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _random_weights(vocab_size: int, special_ids: list[int], seed: int) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    head_dim = HIDDEN_SIZE // NUM_HEADS

    def normal(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        # Not all ones, so that a loader that dropped norm weights would be caught by tests.
        return 1.0 + 0.1 * torch.randn((HIDDEN_SIZE,), generator=gen, dtype=torch.float32)

    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN_SIZE, std=EMBED_STD)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        weights[p + "self_attn.q_proj.weight"] = normal(NUM_HEADS * head_dim, HIDDEN_SIZE)
        weights[p + "self_attn.k_proj.weight"] = normal(NUM_KV_HEADS * head_dim, HIDDEN_SIZE)
        weights[p + "self_attn.v_proj.weight"] = normal(NUM_KV_HEADS * head_dim, HIDDEN_SIZE)
        weights[p + "self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, NUM_HEADS * head_dim)
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
    weights["model.norm.weight"] = norm_weight()
    lm_head = normal(vocab_size, HIDDEN_SIZE)
    # Zero rows give the special tokens logit 0 while ~700 random logits compete around it, so
    # greedy decoding never ends on EOS and sampling rarely does: long outputs for tests and demos.
    lm_head[special_ids] = 0.0
    weights["lm_head.weight"] = lm_head
    return weights


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
