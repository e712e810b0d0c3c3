# Citation: chandar-lab/AMPLIFY src/amplify/model/amplify.py @1121b9c17fde26c7e7b1c9ab1d458891c55db33c (AMPLIFYConfig,
#   EncoderBlock._att_block, AMPLIFY.forward), src/amplify/model/rotary.py, src/amplify/model/rmsnorm.py,
#   src/amplify/tokenizer/tokenizer.py, src/amplify/dataset/data_collator.py @045254e4bb25edbdac34892c1b558e262e9955a4
#   (DataCollatorMLM), src/amplify/inference/embeddings.py (Embedder.embed); xformers' SwiGLU written out.
# Masking: proteins are encoded as <bos> residues <eos>, right-padded with <pad>=0 to the longest protein rounded up to
#   a multiple of 8; the collator turns `x == pad` into an additive float mask (-inf on padding, 0 elsewhere), which
#   AMPLIFY.forward repeats to (B, H, L, L) and passes to scaled_dot_product_attention (CPU path) and to its own
#   softmax when attentions are returned. Rotary positions start at 0 for every protein, so right padding leaves the
#   real tokens' positions untouched.
# Checked against Embedder-style single-protein runs (no padding, no mask): hidden states, logits and attention maps of
#   every real token (bos and eos included) match, and no attention weight falls on padding.
import os
import tempfile
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.functional import scaled_dot_product_attention
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput


# ---------------------------------------------------------------- rotary.py
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)  # type: ignore
    freqs = torch.outer(t, freqs).float()  # type: ignore
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# ---------------------------------------------------------------- rmsnorm.py
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


# ---------------------------------------------------------------- xformers.ops.SwiGLU (non-fused path)
class SwiGLU(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.w12 = nn.Linear(in_features, 2 * hidden_features, bias=bias)
        self.w3 = nn.Linear(hidden_features, out_features, bias=bias)

    def forward(self, x):
        x12 = self.w12(x)
        x1, x2 = x12.chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


# ---------------------------------------------------------------- amplify.py
class AMPLIFYConfig(PretrainedConfig):
    model_type = "AMPLIFY"

    def __init__(
        self,
        hidden_size: int = 960,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 15,
        intermediate_size: int = 3840,
        dropout_prob: float = 0,
        embedding_init_range: float = 0.02,
        decoder_init_range: float = 0.02,
        rms_norm: bool = True,
        norm_eps: float = 1e-05,
        hidden_act: str = "SwiGLU",
        layer_norm_after_embedding: bool = False,
        layer_norm_before_last_layer: bool = True,
        vocab_size: int = 27,
        ffn_bias: bool = False,
        att_bias: bool = False,
        pad_token_id: int = 0,
        max_length: int = 2048,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.dropout_prob = dropout_prob
        self.embedding_init_range = embedding_init_range
        self.decoder_init_range = decoder_init_range
        self.rms_norm = rms_norm
        self.norm_eps = norm_eps
        self.hidden_act = hidden_act
        self.layer_norm_after_embedding = layer_norm_after_embedding
        self.layer_norm_before_last_layer = layer_norm_before_last_layer
        self.vocab_size = vocab_size
        self.ffn_bias = ffn_bias
        self.att_bias = att_bias
        self.pad_token_id = pad_token_id
        self.max_length = max_length


class EncoderBlock(nn.Module):
    """Transformer encoder block."""

    def __init__(self, config: AMPLIFYConfig):
        super().__init__()
        self.config = config
        self.d_head = config.hidden_size // config.num_attention_heads

        # Attention
        self.q = nn.Linear(in_features=config.hidden_size, out_features=config.hidden_size, bias=config.att_bias)
        self.k = nn.Linear(in_features=config.hidden_size, out_features=config.hidden_size, bias=config.att_bias)
        self.v = nn.Linear(in_features=config.hidden_size, out_features=config.hidden_size, bias=config.att_bias)
        self.wo = nn.Linear(in_features=config.hidden_size, out_features=config.hidden_size, bias=config.att_bias)
        self.resid_dropout = nn.Dropout(config.dropout_prob)

        # Feedforward network
        act = config.hidden_act.lower()
        if act == "swiglu":
            multiple_of = 8
            intermediate_size = int(2 * config.intermediate_size / 3)
            intermediate_size = multiple_of * ((intermediate_size + multiple_of - 1) // multiple_of)
            self.ffn = SwiGLU(config.hidden_size, intermediate_size, config.hidden_size, bias=config.ffn_bias)
        elif act == "relu":
            self.ffn = nn.Sequential(
                nn.Linear(config.hidden_size, config.intermediate_size, bias=config.ffn_bias),
                nn.ReLU(),
                nn.Linear(config.intermediate_size, config.hidden_size, bias=config.ffn_bias),
            )
        elif act == "gelu":
            self.ffn = nn.Sequential(
                nn.Linear(config.hidden_size, config.intermediate_size, bias=config.ffn_bias),
                nn.GELU(),
                nn.Linear(config.intermediate_size, config.hidden_size, bias=config.ffn_bias),
            )
        else:
            raise ValueError(f"Unsupported hidden_act: {config.hidden_act}")

        self.attention_norm = RMSNorm(config.hidden_size, config.norm_eps) if config.rms_norm else nn.LayerNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps) if config.rms_norm else nn.LayerNorm(config.hidden_size, config.norm_eps)

        self.ffn_dropout = nn.Dropout(config.dropout_prob)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor, freqs_cis: torch.Tensor, output_attentions: bool):
        attn, contact = self._att_block(self.attention_norm(x), pad_mask, freqs_cis, output_attentions)
        x = x + attn
        x = x + self._ff_block(self.ffn_norm(x))
        return x, contact

    def _att_block(self, x: torch.Tensor, pad_mask: torch.Tensor, freqs_cis: torch.Tensor, output_attentions: bool):
        batch_size, seq_len, _ = x.shape
        xq, xk, xv = self.q(x), self.k(x), self.v(x)

        # Reshape for rotary embeddings
        xq = xq.view(batch_size, seq_len, self.config.num_attention_heads, self.d_head)
        xk = xk.view(batch_size, seq_len, self.config.num_attention_heads, self.d_head)
        xv = xv.view(batch_size, seq_len, self.config.num_attention_heads, self.d_head)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)

        # Compute the attention weight
        attn_weights = None
        if output_attentions:
            attn_weights = xq.permute(0, 2, 1, 3) @ xk.permute(0, 2, 3, 1) / (xq.size(-1) ** 0.5)
            if pad_mask is not None:
                attn_weights = attn_weights + pad_mask
            attn_weights = attn_weights.softmax(-1)

        # (the project calls xformers' memory_efficient_attention with attn_bias=pad_mask when x.is_cuda)
        # Input and output are of dimension (B, H, M, K)
        attn = scaled_dot_product_attention(
            query=xq.transpose(1, 2),
            key=xk.transpose(1, 2),
            value=xv.transpose(1, 2),
            attn_mask=pad_mask,
            dropout_p=self.config.dropout_prob if self.training else 0,
        ).transpose(1, 2)

        attn_scores = self.wo(attn.reshape(batch_size, seq_len, self.config.num_attention_heads * self.d_head))
        return (self.resid_dropout(attn_scores), attn_weights)

    def _ff_block(self, x: torch.Tensor):
        return self.ffn_dropout(self.ffn(x))


class AMPLIFYPreTrainedModel(PreTrainedModel):
    config_class = AMPLIFYConfig

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.uniform_(-self.config.decoder_init_range, self.config.decoder_init_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.uniform_(-self.config.embedding_init_range, self.config.embedding_init_range)


class AMPLIFY(AMPLIFYPreTrainedModel):
    def __init__(self, config: AMPLIFYConfig, **kwargs):
        super().__init__(config)
        self.config = config

        self.encoder = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)

        if config.layer_norm_after_embedding:
            self.layer_norm_1 = RMSNorm(config.hidden_size, config.norm_eps) if config.rms_norm else nn.LayerNorm(config.hidden_size, config.norm_eps)

        self.transformer_encoder = nn.ModuleList()
        for _ in range(config.num_hidden_layers):
            self.transformer_encoder.append(EncoderBlock(config))

        if config.layer_norm_before_last_layer:
            self.layer_norm_2 = RMSNorm(config.hidden_size, config.norm_eps) if config.rms_norm else nn.LayerNorm(config.hidden_size, config.norm_eps)

        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

        self.freqs_cis = precompute_freqs_cis(config.hidden_size // config.num_attention_heads, config.max_length)

        self.post_init()

    def forward(self, src, pad_mask=None, output_hidden_states=False, output_attentions=False):
        hidden_states, attentions = [], []

        # Expand and repeat: (Batch, Length) -> (Batch, Heads, Length, Length)
        if pad_mask is not None:
            assert pad_mask.dtype != torch.bool and 1.0 not in pad_mask, "AMPLIFY expects an additive pad_mask"
            pad_mask = pad_mask.unsqueeze(1).unsqueeze(1).repeat(1, self.config.num_attention_heads, pad_mask.size(-1), 1)

        # RoPE
        self.freqs_cis = self.freqs_cis.to(src.device, non_blocking=True)
        freqs_cis = self.freqs_cis[: src.shape[1]]

        # Embedding
        x = self.encoder(src)
        if self.config.layer_norm_after_embedding:
            x = self.layer_norm_1(x)

        # Transformer encoder
        for layer in self.transformer_encoder:
            x, attn = layer(x, pad_mask, freqs_cis, output_attentions)
            if output_hidden_states:
                hidden_states.append(x)
            if output_attentions:
                attentions.append(attn)

        # Classification head with layer norm
        logits = self.decoder(self.layer_norm_2(x) if self.config.layer_norm_before_last_layer else x)

        return MaskedLMOutput(logits=logits, hidden_states=hidden_states, attentions=attentions)


# ---------------------------------------------------------------- tokenizer.py
class ProteinTokenizer(object):
    def __init__(self, vocab_path: str, pad_token_id: int, mask_token_id: int, bos_token_id: int, eos_token_id: int,
                 unk_token_id: int, other_special_token_ids: list | None, **kwargs):
        self._token_to_id = dict()
        self._id_to_token = dict()

        with open(vocab_path, "r") as vocab_file:
            for i, token in enumerate(vocab_file):
                token = token.strip()
                self._token_to_id[token] = i
                self._id_to_token[i] = token

        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.mask_token_id = mask_token_id
        self.unk_token_id = unk_token_id

        self.special_token_ids = set()
        self.special_token_ids.add(pad_token_id)
        self.special_token_ids.add(mask_token_id)
        self.special_token_ids.add(bos_token_id)
        self.special_token_ids.add(eos_token_id)
        self.special_token_ids.add(unk_token_id)
        if other_special_token_ids is not None:
            self.special_token_ids.add(other_special_token_ids)

    def __len__(self) -> int:
        return len(self._token_to_id)

    def token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, self.unk_token_id)

    def encode(self, tokens: List[str], max_length: int | None = None, add_special_tokens: bool = True,
               random_truncate: bool = True, **kwargs) -> List | Tensor:
        token_ids = list(map(self.token_to_id, tokens))
        if add_special_tokens:
            token_ids = [self.bos_token_id] + token_ids + [self.eos_token_id]
        if max_length is not None and max_length < len(token_ids):
            offset = int(torch.randint(0, len(token_ids) - max_length, (1,))) if random_truncate else 0
            token_ids = token_ids[offset : offset + max_length]
        return torch.as_tensor(token_ids, dtype=torch.long)


# ---------------------------------------------------------------- data_collator.py (no-masking branch)
class DataCollatorMLM(object):
    def __init__(self, tokenizer: ProteinTokenizer, max_length: int, random_truncate: bool, return_labels: bool,
                 mask_probability: float, padding: str, pad_to_multiple_of: int, dtype: torch.dtype, **kwargs) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.random_truncate = random_truncate
        self.return_labels = return_labels
        self.mask_probability = mask_probability
        self.padding = padding
        self.pad_to_multiple_of = pad_to_multiple_of
        self.dtype = dtype

    def __call__(self, inputs: List[Tuple]) -> Tuple[Tensor, Tensor, Tensor]:
        labels, proteins = zip(*inputs)
        proteins = [self.tokenizer.encode(p, self.max_length, random_truncate=self.random_truncate) for p in proteins]

        if self.padding == "longest":
            max_length = max(p.size(0) for p in proteins)
        elif self.padding == "max_length":
            max_length = self.max_length

        # Pad the sequence to a multiple of the provided value. Necessary for memory efficient attention
        if self.pad_to_multiple_of is not None and (max_length % self.pad_to_multiple_of != 0):
            max_length = ((max_length // self.pad_to_multiple_of) + 1) * self.pad_to_multiple_of

        x = torch.full(size=(len(proteins), max_length), fill_value=self.tokenizer.pad_token_id, dtype=torch.long)
        for i, p in enumerate(proteins):
            x[i, : p.shape[0]] = p

        pad_mask = x == self.tokenizer.pad_token_id

        assert self.mask_probability is None or self.mask_probability == 0
        # Replace masked position with float(-inf)
        pad_mask = torch.where(pad_mask, float("-inf"), float(0.0)).type(self.dtype)
        y = torch.full(x.shape, -100)
        return (labels, x, y, pad_mask) if self.return_labels else (x, y, pad_mask)


def main():
    torch.manual_seed(0)
    vocab = ["<pad>", "<unk>", "<mask>", "<bos>", "<eos>", "|"] + list("LAGVSERTIDPKQNFYMHWCX")
    with tempfile.TemporaryDirectory() as tmp:
        vocab_path = os.path.join(tmp, "amplify_vocab.txt")
        with open(vocab_path, "w") as f:
            f.write("\n".join(vocab) + "\n")
        tokenizer = ProteinTokenizer(vocab_path, pad_token_id=0, mask_token_id=2, bos_token_id=3, eos_token_id=4,
                                     unk_token_id=1, other_special_token_ids=None)

    config = AMPLIFYConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=192,
                           vocab_size=len(tokenizer), pad_token_id=0, max_length=128)
    model = AMPLIFY(config).eval()

    proteins = [
        ("sp|P01308", "MALWMRLLPLLALLALWGPDPAAAFVNQHLCGSHLVEALY"),
        ("sp|P69905", "MVLSPADKTNVKAAWGKVGAHAGEY"),
        ("sp|P62988", "MQIFVKTLTGK"),
        ("sp|P00698", "KVFGRCELAAAMKRHGLDNYRGYSLGNWVC"),
    ]
    collator = DataCollatorMLM(tokenizer, max_length=64, random_truncate=False, return_labels=True,
                               mask_probability=0, padding="longest", pad_to_multiple_of=8, dtype=torch.float32)
    names, x, y, pad_mask = collator(proteins)
    print(f"batch {tuple(x.shape)}, padded keys per protein {(pad_mask == float('-inf')).sum(-1).tolist()}")

    with torch.no_grad():
        out = model(x, pad_mask, output_hidden_states=True, output_attentions=True)

    max_err = 0.0
    for i, (name, seq) in enumerate(proteins):
        # Embedder.embed: one protein, no padding, no pad_mask
        ids = tokenizer.encode(seq, random_truncate=False).unsqueeze(0)
        n = ids.size(1)
        with torch.no_grad():
            ref = model(ids, output_hidden_states=True, output_attentions=True)
        emb = out.hidden_states[-1][i, 1:n - 1]
        ref_emb = ref.hidden_states[-1][0][1:-1, :]
        errs = [
            (emb - ref_emb).abs().max().item(),
            (out.logits[i, :n] - ref.logits[0]).abs().max().item(),
        ]
        for layer_attn, ref_attn in zip(out.attentions, ref.attentions):
            errs.append((layer_attn[i, :, :n, :n] - ref_attn[0]).abs().max().item())
            assert layer_attn[i, :, :n, n:].abs().max().item() == 0.0
        err = max(errs)
        max_err = max(max_err, err)
        pred = tokenizer._id_to_token
        top = "".join(pred[t] for t in out.logits[i, 1:n - 1].argmax(-1).tolist()[:8])
        print(f"{name}: {n - 2} residues, max |batched - single| {err:.2e}, first predicted residues {top}")
        assert err < 1e-5, err
    print(f"all proteins match their single-protein runs (max err {max_err:.2e})")


if __name__ == "__main__":
    main()
