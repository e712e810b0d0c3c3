"""llama.cpp convert_hf_to_gguf.py: EmbeddingGemma is converted with the transformers-adjusted sliding window.

Citation: ggml-org/llama.cpp PR #15867 ("convert : force setting sliding_window from original config";
description and review diff read). It references transformers PR #40700, whose `Gemma3TextConfig`
constructor rewrites `sliding_window` to `sliding_window // 2 + 1` when `use_bidirectional_attention`
is set. The converter below follows `EmbeddingGemma.set_gguf_parameters` (hparams loaded through the
transformers config, `gguf_writer.add_sliding_window`); the runtime side is a torch port of llama.cpp's
symmetric SWA test (`LLAMA_SWA_TYPE_SYMMETRIC`: masked when `|p1 - p0| > n_swa / 2`) feeding SDPA.

Bug: the converter's hparams come from `AutoConfig.from_pretrained(...).to_dict()`, so the GGUF stores
the already-halved value (512 -> 257). llama.cpp halves `n_swa` itself for the symmetric window, so an
embedding model converted this way attends |i - j| <= 128 instead of <= 256 on its sliding layers.

Fix: read `sliding_window` from the original `config.json` and write that into the GGUF.

Reproduction: an in-memory `config.json` (`sliding_window = 6`), a stand-in for the transformers config
class, the converter writing GGUF key/values into a dict (no file written), then a sliding layer of the
converted model encoding 10 tokens with the symmetric SWA mask.
"""
import json
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# the checkpoint directory's config.json, kept in memory
CONFIG_JSON = json.dumps({
    "architectures": ["Gemma3TextModel"], "model_type": "gemma3_text", "hidden_size": 24,
    "num_attention_heads": 3, "head_dim": 8, "vocab_size": 64, "sliding_window": 6,
    "use_bidirectional_attention": True,
})


class Gemma3TextConfig:
    """What `AutoConfig.from_pretrained` returns for this checkpoint (transformers >= PR #40700)."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
        if self.use_bidirectional_attention:
            self.sliding_window = (self.sliding_window // 2) + 1  # due to fa we set exclusive bounds

    def to_dict(self):
        return dict(self.__dict__)


class GGUFWriter:
    def __init__(self):
        self.kv = {}

    def add_sliding_window(self, value):
        self.kv["gemma-embedding.attention.sliding_window"] = value

    def add_head_count(self, value):
        self.kv["gemma-embedding.attention.head_count"] = value


class EmbeddingGemma:
    def __init__(self, dir_model_files):
        self.dir_model_files = dir_model_files
        self.hparams = self.load_hparams()
        self.gguf_writer = GGUFWriter()

    def load_hparams(self):
        # hparams go through the transformers config class when it is available
        return Gemma3TextConfig(**json.loads(self.dir_model_files["config.json"])).to_dict()

    def set_gguf_parameters(self):
        self.gguf_writer.add_head_count(self.hparams["num_attention_heads"])
        self.gguf_writer.add_sliding_window(self.hparams["sliding_window"])
        if FIXED:
            # Override the sliding window size as it gets adjusted by the Gemma3TextConfig
            # constructor. We want to use the value from the original model's config.json.
            config = json.loads(self.dir_model_files["config.json"])
            orig_sliding_window = config.get("sliding_window")
            if orig_sliding_window is None:
                raise ValueError("sliding_window not found in model config - this is required for the model")
            self.gguf_writer.add_sliding_window(orig_sliding_window)


def is_masked_swa_symmetric(n_swa: int, p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """llama.cpp LLAMA_SWA_TYPE_SYMMETRIC: key at p0 is masked for query at p1 outside +-n_swa/2."""
    half_n_swa = n_swa // 2
    pos_diff = p1 - p0
    return (pos_diff < -half_n_swa) | (pos_diff > half_n_swa)


def main():
    converter = EmbeddingGemma({"config.json": CONFIG_JSON})
    converter.set_gguf_parameters()
    n_swa = converter.gguf_writer.kv["gemma-embedding.attention.sliding_window"]
    print("GGUF sliding_window", n_swa)

    hidden, heads, head_dim, n_tokens = 24, 3, 8, 10
    embed = torch.nn.Embedding(64, hidden)
    wqkv = torch.nn.Linear(hidden, 3 * heads * head_dim, bias=False)
    pos = torch.arange(n_tokens)
    kq_mask = ~is_masked_swa_symmetric(n_swa, pos[None, :], pos[:, None])   # [query, key], True = attend
    with torch.no_grad():
        x = embed(torch.randint(0, 64, (1, n_tokens)))
        q, k, v = wqkv(x).view(1, n_tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=kq_mask)
    print("mean-pooled embedding norm", round(float(out.mean(2).norm()), 4))


if __name__ == "__main__":
    main()
