# Sockeye 3, awslabs/sockeye commit 60adf20d (3.1.34, "Fixes to blocking cross-attention"; PR #1087).
# prepare_source_length_mask defaulted to mask_prepended_tokens=True, so TransformerEncoder's self-attention
# (which does not pass the flag) hid every prepended source token (up to the end-of-prepending tag) from all queries.
import sys
from dataclasses import dataclass

import torch as pt
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
pt.manual_seed(0)


def prepare_source_length_mask(lengths: pt.Tensor, heads: int, max_length: int, expand: bool = True,
                               mask_prepended_tokens: bool = (False if FIXED else True)) -> pt.Tensor:
    """
    Prepare source length masks where positions of invalid tokens are marked as True.

    :param lengths: Total source length and prepended source length. Shape: (batch_size, 2)
    """
    # (batch_size, max_len)
    mask = ~(pt.arange(max_length, device=lengths.device).unsqueeze(0) < lengths[:, :1])
    if mask_prepended_tokens:
        prepended_token_mask = pt.arange(max_length, device=lengths.device).unsqueeze(0) < lengths[:, 1:2]
        mask |= prepended_token_mask
    if expand:
        # (batch_size * heads, 1, max_len)
        mask = mask.unsqueeze(1).expand(-1, heads, -1).reshape((-1, max_length)).unsqueeze(1)
    return mask


@dataclass
class TransformerConfig:
    model_size: int = 32
    attention_heads: int = 4
    feed_forward_num_hidden: int = 64
    num_layers: int = 2
    max_seq_len_source: int = 32


class MultiHeadSelfAttention(pt.nn.Module):
    def __init__(self, depth_att: int, heads: int, depth_out: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.depth = depth_att
        self.heads = heads
        self.ff_in = pt.nn.Linear(in_features=depth_att, out_features=depth_att * 3, bias=False)
        self.ff_out = pt.nn.Linear(in_features=depth_att, out_features=depth_out, bias=False)
        self._drop_p = dropout

    def forward(self, inputs, previous_states=None, mask=None, **args):
        # training path: fused multi-head attention op
        contexts, _ = F.multi_head_attention_forward(query=inputs, key=inputs, value=inputs,
                                                     embed_dim_to_check=self.depth, num_heads=self.heads,
                                                     in_proj_weight=self.ff_in.weight,
                                                     in_proj_bias=None,
                                                     bias_k=None, bias_v=None, add_zero_attn=False,
                                                     dropout_p=self._drop_p,
                                                     out_proj_weight=self.ff_out.weight,
                                                     out_proj_bias=self.ff_out.bias,
                                                     training=self.training,
                                                     key_padding_mask=None,
                                                     need_weights=False,
                                                     attn_mask=mask,
                                                     use_separate_proj_weight=False)
        return contexts, contexts  # dummy return


class TransformerEncoderBlock(pt.nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.pre_self_attention = pt.nn.LayerNorm(config.model_size)  # preprocess "n"
        self.self_attention = MultiHeadSelfAttention(config.model_size, config.attention_heads, config.model_size)
        self.pre_ff = pt.nn.LayerNorm(config.model_size)
        self.ff = pt.nn.Sequential(pt.nn.Linear(config.model_size, config.feed_forward_num_hidden), pt.nn.ReLU(),
                                   pt.nn.Linear(config.feed_forward_num_hidden, config.model_size))

    def forward(self, data: pt.Tensor, att_mask: pt.Tensor = None) -> pt.Tensor:
        data_self_att, _ = self.self_attention(inputs=self.pre_self_attention(data), previous_states=None,
                                               mask=att_mask, bias=None)
        data = data_self_att + data  # postprocess "r"
        data = self.ff(self.pre_ff(data)) + data
        return data


class TransformerEncoder(pt.nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        pe = pt.zeros(config.max_seq_len_source, config.model_size)
        pos = pt.arange(config.max_seq_len_source).unsqueeze(1).float()
        div = pt.exp(pt.arange(0, config.model_size, 2).float() * (-9.21 / config.model_size))
        pe[:, 0::2], pe[:, 1::2] = pt.sin(pos * div), pt.cos(pos * div)
        self.register_buffer("pe", pe)
        self.layers = pt.nn.ModuleList(TransformerEncoderBlock(config) for _ in range(config.num_layers))
        self.final_process = pt.nn.LayerNorm(config.model_size)

    def forward(self, data: pt.Tensor, valid_length: pt.Tensor):
        data = data * self.config.model_size ** 0.5 + self.pe[:data.size(1)]
        _, max_len, __ = data.size()
        # length_mask for source attention masking. Shape: (batch_size, max_len)
        single_head_att_mask = prepare_source_length_mask(valid_length, self.config.attention_heads,
                                                          max_length=max_len, expand=False)
        # Shape: (batch_size, max_len) -> (batch_size * heads, 1, max_len)
        att_mask = single_head_att_mask.unsqueeze(1).expand(-1, self.config.attention_heads, -1) \
            .reshape((-1, max_len)).unsqueeze(1)
        att_mask = att_mask.expand(-1, max_len, -1)

        data = data.transpose(1, 0)  # batch to time major
        for layer in self.layers:
            data = layer(data, att_mask=att_mask)
        data = self.final_process(data)
        data = data.transpose(1, 0)  # time to batch major
        return data, valid_length, single_head_att_mask


config = TransformerConfig()
embedding = pt.nn.Embedding(50, config.model_size)
encoder = TransformerEncoder(config)
encoder.train()  # training step path (fused MHA), dropout 0

# batch of 3 sources; column 0 = total length, column 1 = prepended length (incl. end-of-prepending tag)
valid_length = pt.tensor([[10, 4], [8, 3], [12, 0]])
tokens = pt.randint(3, 50, (3, 12))
for i, n in enumerate(valid_length[:, 0].tolist()):
    tokens[i, n:] = 0
emb = embedding(tokens)

out, _, src_mask = encoder(emb, valid_length)
# reference: same sources with no prepending info -- encoder self-attention must not depend on it
ref, _, _ = encoder(emb, valid_length * pt.tensor([1, 0]))

valid = pt.arange(12).unsqueeze(0) < valid_length[:, :1]
diff = (out - ref).abs()[valid].max().item()
loss = out[valid].pow(2).mean()
loss.backward()
print(f"max |encoder(prepended lengths) - encoder(no prepended info)| over real tokens = {diff:.6f}")
