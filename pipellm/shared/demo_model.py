"""A tiny, deterministic, random-weight Llama checkpoint for demos and tests.

`ensure_demo_model()` writes a directory in the exact Hugging Face layout (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat
template) without needing transformers or a model hub. The weights are random, so the text it
generates is gibberish, but every build in the same environment produces the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENV_VAR = "PIPELLM_DEMO_DIR"
DEFAULT_DIR = Path("~/.cache/pipellm/demo-llama")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")
_ADDED_LATER = ("tokenizer_config.json",)  # older builds lack these: added in place on use

UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2, as in Llama tokenizers
VOCAB_SIZE = 1000
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 128, 4, 4, 2, 256
MAX_POSITIONS = 2048
# ChatML's layout with the tokenizer's own <s> / </s> as the turn markers: every turn is
# "<s>{role}\n{content}</s>\n", and a reply ends with </s>, which is EOS, so generation stops there.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role'] + '; expected system, user or "
    "assistant') }}"
    "{% endif %}"
    "{{ bos_token + message['role'] + '\n' + message['content'] | trim + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\n' }}{% endif %}"
)
SEED = 0
INIT_STD = 0.02

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model reads a prompt, turns it into
tokens, and predicts the next token one step at a time. Each step looks at every token that came
before it through attention, and the keys and values of earlier tokens are kept in a cache so
they do not have to be computed again.

Serving many requests at once is a scheduling problem. The server batches the prompts of new
requests together with the decoding steps of running ones, so that the accelerator stays busy.
When memory runs short, some requests have to wait, and the scheduler decides which ones go
first. Throughput and latency pull in different directions, and a good server balances both.

Once upon a time there was a small village by the river. The people who lived there grew wheat
and apples, and every autumn they held a market where farmers, bakers and travellers met to
trade their goods. Children ran between the stalls, dogs barked at the horses, and in the
evening everyone gathered around the fire to tell stories about the mountains in the north.

Numbers and symbols appear in text too: 1, 2, 3, 10, 42, 100, 2024; prices such as $5.99;
percentages like 75%; code like print("hello, world") or x = y + 1; and questions such as: what
time is it? Where are we going? Why does the sky look blue during the day and red at sunset?

Science tries to explain the world with careful observation. Water boils at one hundred degrees
at sea level, light travels faster than sound, and the earth moves around the sun once every
year. Scientists write down what they measure, share their results, and test each other's ideas
again and again until the evidence is strong enough to trust.

The kitchen smelled of fresh bread and coffee. She opened the window, looked at the garden, and
wondered whether it would rain before noon. Her brother was still asleep upstairs, the cat was
chasing a fly across the table, and the radio played an old song about summer, friendship and
the long road home. It was going to be a quiet morning, or so she thought.

Computers store everything as bytes. A program written in Python, Rust or C is compiled or
interpreted into instructions that the processor executes. Memory is fast but limited, disks are
large but slow, and networks connect machines across the world. Engineers measure performance,
find the bottleneck, and improve the system one change at a time, with tests to keep it correct.
"""


def ensure_demo_model(root: Path | None = None) -> Path:
    """Return a directory holding the demo checkpoint, building it first if needed.

    `root` defaults to $PIPELLM_DEMO_DIR, else ~/.cache/pipellm/demo-llama. The directory is
    built in a temporary sibling and renamed into place, so concurrent callers are safe.
    """
    root = Path(root or os.environ.get(ENV_VAR) or DEFAULT_DIR).expanduser()
    if _is_complete(root):
        return root
    if _is_older_build(root):
        _add_later_files(root)
        return root
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"{root} exists but is not a complete demo model; remove it")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished model is an ordinary dir
        _write_demo_model(tmp)
        try:
            os.rename(tmp, root)
        except OSError:
            if not _is_complete(root):  # lost the race to a concurrent builder: fine if it won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def build_demo_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer trained on the built-in corpus; encodes any text."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def _is_complete(root: Path) -> bool:
    return all((root / name).is_file() for name in FILES)


def _is_older_build(root: Path) -> bool:
    """A build from before the files in _ADDED_LATER existed (its other files are unchanged)."""
    return all((root / n).is_file() for n in FILES if n not in _ADDED_LATER)


def _add_later_files(root: Path) -> None:
    """Write the missing _ADDED_LATER files into an older build, each atomically (a temporary
    file renamed into place), so concurrent callers all end with the same bytes."""
    for name in _ADDED_LATER:
        if (root / name).is_file():
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=root)
        os.close(fd)
        try:
            _write_json(Path(tmp), _tokenizer_config())
            os.chmod(tmp, 0o644)
            os.replace(tmp, root / name)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _tokenizer_config() -> dict:
    """tokenizer_config.json: special tokens and the chat template (loads in transformers)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_demo_model(out: Path) -> None:
    tok = build_demo_tokenizer()
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation)
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    save_file(_random_weights(vocab), str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in FILES:
        (out / name).chmod(0o644)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _random_weights(vocab: int) -> dict[str, torch.Tensor]:
    """HF-named Llama tensors: normal(0, INIT_STD) matrices, RMSNorm weights of one."""
    head_dim = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (HEADS * head_dim, HIDDEN)
        shapes[p + "self_attn.k_proj.weight"] = (KV_HEADS * head_dim, HIDDEN)
        shapes[p + "self_attn.v_proj.weight"] = (KV_HEADS * head_dim, HIDDEN)
        shapes[p + "self_attn.o_proj.weight"] = (HIDDEN, HEADS * head_dim)
        shapes[p + "mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (vocab, HIDDEN)
    gen = torch.Generator().manual_seed(SEED)
    return {
        name: torch.ones(shape)
        if len(shape) == 1
        else torch.randn(shape, generator=gen, dtype=torch.float32) * INIT_STD
        for name, shape in shapes.items()
    }
