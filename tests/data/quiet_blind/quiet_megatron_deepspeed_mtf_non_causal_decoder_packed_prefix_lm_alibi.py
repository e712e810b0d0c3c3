"""BigScience Megatron-DeepSpeed: multitask finetuning of a non-causal (prefix-LM) decoder, packed.

Citation: bigscience-workshop/Megatron-DeepSpeed @8387ae17c4704f6579f88a84500b535d19d7fbbf
    finetune_t0_non_causal_decoder.py          get_batch_pipe (the T0 / mT0 / BLOOMZ training step)
    megatron/data/decoder_packed_mtf_dataset.py DecoderPackedMTFDataset.pack_samples
    megatron/utils.py                           get_ltor_masks_and_position_ids, get_packed_attention_mask
    megatron/model/transformer.py               ParallelAttention.forward (baddbmm into the ALiBi tensor),
                                                ParallelTransformerLayer._build_alibi_tensor
    megatron/model/fused_softmax.py             FusedScaleMaskSoftmax.forward_torch_softmax
    megatron/model/utils.py                     attention_mask_func
    megatron/model/gpt_model.py                 get_cross_entropy(is_prefix=False)

Each packed row holds several (input, target) samples back to back and is right-padded with
`pad` (segment id 0).  Every sample's inputs attend each other both ways, its targets attend
causally (inputs included), nothing crosses a segment and nothing sees padding.  Positions are
ALiBi (absolute key-position bias, as BLOOM), so no position ids need resetting per segment.
One deviation from the script: the loss drops positions whose *label* is padding (the script
tests the input token), so no target is trained to predict the pad after its last token.

The program runs one training step and checks it against each sample run alone, unpacked and
unpadded, with attention written as a loop over query positions.
"""
import math
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

_ARGS = SimpleNamespace(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=24,
    micro_batch_size=3,
    padded_vocab_size=50,
    position_embedding_type="alibi",
    apply_query_key_layer_scaling=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    reset_position_ids=False,
    reset_attention_mask=False,
    eod_mask_loss=False,
    curriculum_learning=False,
    init_method_std=0.02,
    lr=1e-3,
)


def get_args():
    return _ARGS


class _Tokenizer:
    pad = 3
    eos = 2
    eod = 2


def get_tokenizer():
    return _Tokenizer


# ----------------------------------------------------------------------------
# megatron/data/decoder_packed_mtf_dataset.py
# ----------------------------------------------------------------------------
class DecoderPackedMTFDataset:
    def __init__(self, seq_length, pad_token, eos_token):
        self.seq_length = seq_length
        self.pad_token = pad_token
        self.eos_token = eos_token

    def pack_samples(self, items):
        """Greedily packs samples.

        decoder_tokens = [[6, 7, 8, 3, 4, 5, <pad>]]
        decoder_segment_ids = [[1, 1, 1, 2, 2, 2, 0]]
        decoder_is_inputs = [[1, 1, 0, 1, 1, 0, 0]]
        """
        decoder_tokens = np.full((self.seq_length,), self.pad_token, dtype=np.int64)
        decoder_segment_ids = np.zeros((self.seq_length,), dtype=np.int64)
        decoder_is_inputs = np.full((self.seq_length,), False, dtype=bool)

        # `0` is reserved for padding
        item_num = 1
        cur_len = 0

        assert len(items) > 0

        for token_dict in items:
            input_token_len = len(token_dict["input_tokens"])
            target_token_len = len(token_dict["target_tokens"])

            total_len = input_token_len + target_token_len

            if cur_len + total_len > self.seq_length:
                raise ValueError("Items to be packed do not fit inside a single sample.")

            decoder_tokens[cur_len: cur_len + input_token_len] = token_dict["input_tokens"]
            decoder_tokens[cur_len + input_token_len: cur_len + total_len] = token_dict["target_tokens"]
            decoder_segment_ids[cur_len: cur_len + total_len] = item_num
            decoder_is_inputs[cur_len: cur_len + input_token_len] = 1  # inputs

            item_num += 1
            cur_len += total_len
            assert cur_len <= self.seq_length

        return {
            "decoder_token_ids": decoder_tokens,
            "decoder_segment_ids": decoder_segment_ids,
            "decoder_is_inputs": decoder_is_inputs,
        }


def default_collate(rows):
    return {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}


# ----------------------------------------------------------------------------
# megatron/utils.py
# ----------------------------------------------------------------------------
def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask,
                                    eod_mask_loss, prefix_indices, loss_on_targets_only):
    """Build masks and position id for left to right model (the prefix_indices=None,
    reset_attention_mask=False path that the MTF script takes)."""
    micro_batch_size, seq_length = data.size()

    # Attention mask (lower triangular).
    if reset_attention_mask or prefix_indices is not None:
        att_mask_batch = micro_batch_size
    else:
        att_mask_batch = 1
    attention_mask = torch.tril(torch.ones(
        (att_mask_batch, seq_length, seq_length), device=data.device)).view(
            att_mask_batch, 1, seq_length, seq_length)

    # Loss mask.
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0

    # Position ids.
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)

    assert not (reset_position_ids or reset_attention_mask or prefix_indices is not None)

    # Convert attention mask to binary:
    attention_mask = (attention_mask < 0.5)

    return attention_mask, loss_mask, position_ids


def get_packed_attention_mask(is_causal, causal_mask, decoder_is_inputs, segment_ids):
    """Inspired by t5x/examples/decoder_only/layers.py.

    causal_mask: torch.BoolTensor [batch_size, sequence_length, sequence_length]
    decoder_is_inputs: torch.BoolTensor [batch_size, sequence_length]
    segment_ids: torch.IntTensor [batch_size, sequence_length]
    Returns attention_mask: torch.BoolTensor [batch_size, 1, sequence_length, sequence_length]
    """
    assert causal_mask.dtype == torch.bool
    assert segment_ids.dtype == torch.long
    if is_causal:
        causal_inputs_mask = causal_mask
    else:
        assert decoder_is_inputs.dtype == torch.bool
        inputs_mask = decoder_is_inputs[:, None, :, None] * decoder_is_inputs[:, None, None, :]
        causal_inputs_mask = causal_mask + inputs_mask

    padding_mask = (segment_ids != 0)[:, None, :, None] * (segment_ids != 0)[:, None, None, :]

    segment_mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]

    attention_mask = causal_inputs_mask * padding_mask * segment_mask

    # Convert attention mask to binary:
    attention_mask = (attention_mask < 0.5)

    return attention_mask


# ----------------------------------------------------------------------------
# finetune_t0_non_causal_decoder.py
# ----------------------------------------------------------------------------
def get_batch_pipe(data):
    """
    data:
    decoder_tokens = [[6, 7, 8, 3, 4, 5, 0]]
    decoder_segment_ids = [[1, 1, 1, 2, 2, 2, 0]]
    decoder_is_inputs = [[1, 1, 0, 1, 1, 0, 0]]
    """
    args = get_args()
    tokenizer = get_tokenizer()

    # Unpack.
    tokens_ = data["decoder_token_ids"].long()
    labels = tokens_[:, 1:].contiguous()
    tokens = tokens_[:, :-1].contiguous()

    segment_ids = data["decoder_segment_ids"].long()[:, :-1]
    decoder_is_inputs = data["decoder_is_inputs"][:, :-1]

    # Get the masks and position ids.
    causal_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens,
        tokenizer.eod,
        args.reset_position_ids,
        args.reset_attention_mask,
        args.eod_mask_loss,
        prefix_indices=None,
        loss_on_targets_only=False  # This is done below
    )
    # Only compute loss over causal target tokens, i.e. ignore input_tokens & padding
    loss_on_targets_only = ~data["decoder_is_inputs"][:, 1:]
    loss_on_non_pad_only = (labels != tokenizer.pad)
    loss_mask *= loss_on_targets_only * loss_on_non_pad_only

    attention_mask = get_packed_attention_mask(
        # Run non-causal decoder
        is_causal=False,
        causal_mask=~(causal_mask.bool()),
        decoder_is_inputs=decoder_is_inputs.bool(),
        segment_ids=segment_ids.long(),
    )

    if args.position_embedding_type not in ["alibi", "rotary"]:
        raise NotImplementedError("absolute positional embeddings require us to reset position_ids accordingly.")

    return (tokens, position_ids, attention_mask), (labels, loss_mask)


# ----------------------------------------------------------------------------
# megatron/model/utils.py, fused_softmax.py
# ----------------------------------------------------------------------------
def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, torch.finfo(attention_scores.dtype).min)
    return attention_scores


class FusedScaleMaskSoftmax(nn.Module):
    """attn_mask_type=AttnMaskType.custom; on CPU only the torch path runs."""

    def __init__(self, mask_func, scale):
        super().__init__()
        self.mask_func = mask_func
        self.scale = scale

    def forward(self, input, mask):
        return self.forward_torch_softmax(input, mask)

    def forward_torch_softmax(self, input, mask):
        if self.scale is not None:
            input = input * self.scale
        mask_output = self.mask_func(input, mask) if mask is not None else input
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        return probs


# ----------------------------------------------------------------------------
# megatron/model/transformer.py
# ----------------------------------------------------------------------------
def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = (2 ** (-2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest_power_of_2) + get_slopes(2 * closest_power_of_2)[0::2][
        :n - closest_power_of_2]


class ParallelAttention(nn.Module):
    def __init__(self, layer_number):
        super().__init__()
        args = get_args()
        self.layer_number = max(1, layer_number)
        self.apply_query_key_layer_scaling = args.apply_query_key_layer_scaling
        self.num_attention_heads_per_partition = args.num_attention_heads
        self.hidden_size_per_attention_head = args.hidden_size // args.num_attention_heads
        self.hidden_size_per_partition = args.hidden_size

        self.query_key_value = nn.Linear(args.hidden_size, 3 * args.hidden_size)

        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if self.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.scale_mask_softmax = FusedScaleMaskSoftmax(attention_mask_func, coeff)
        self.attention_dropout = nn.Dropout(args.attention_dropout)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, hidden_states, attention_mask, alibi=None):
        # hidden_states: [sq, b, h]
        mixed_x_layer = self.query_key_value(hidden_states)
        new_tensor_shape = mixed_x_layer.size()[:-1] + \
            (self.num_attention_heads_per_partition, 3 * self.hidden_size_per_attention_head)
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)
        (query_layer, key_layer, value_layer) = torch.chunk(mixed_x_layer, 3, dim=-1)

        # [b, np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2),
                       query_layer.size(0), key_layer.size(0))

        # [sq, b, np, hn] -> [sq, b * np, hn]
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        # [sk, b, np, hn] -> [sk, b * np, hn]
        key_layer = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)

        matmul_result = alibi[:output_size[0] * output_size[1], :, :output_size[3]]

        if self.apply_query_key_layer_scaling:
            beta = 1.0 / self.layer_number
        else:
            beta = 1.0

        matmul_result = torch.baddbmm(
            matmul_result,
            query_layer.transpose(0, 1),  # [b * np, sq, hn]
            key_layer.transpose(0, 1).transpose(1, 2),  # [b * np, hn, sk]
            beta=beta, alpha=(1.0 / self.norm_factor))

        # change view to [b, np, sq, sk]
        attention_scores = matmul_result.view(*output_size)

        # attention scores and attention mask [b, np, sq, sk]
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        attention_probs = self.attention_dropout(attention_probs)

        # [b, np, sq, hn]
        output_size = (value_layer.size(1), value_layer.size(2),
                       query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)

        # [b, np, sq, hn] --> [sq, b, hp]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        context_layer = context_layer.view(*context_layer.size()[:-2], self.hidden_size_per_partition)
        return self.dense(context_layer)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, layer_number):
        super().__init__()
        args = get_args()
        self.input_layernorm = nn.LayerNorm(args.hidden_size)
        self.self_attention = ParallelAttention(layer_number)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, args.ffn_hidden_size), nn.GELU(),
                                 nn.Linear(args.ffn_hidden_size, args.hidden_size))
        self.alibi = self._build_alibi_tensor(args.seq_length, args.num_attention_heads,
                                              args.micro_batch_size)

    @staticmethod
    def _build_alibi_tensor(max_seq_len, num_attention_heads, batch_size):
        """Returns tensor shaped (batch_size * num_attention_heads, 1, max_seq_len)"""
        slopes = torch.Tensor(get_slopes(num_attention_heads))
        alibi = slopes.unsqueeze(1).unsqueeze(1) * torch.arange(max_seq_len).unsqueeze(0).unsqueeze(0).expand(
            num_attention_heads, -1, -1)
        alibi = alibi.repeat(batch_size, 1, 1)
        return alibi

    def forward(self, hidden_states, attention_mask):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(layernorm_output, attention_mask, alibi=self.alibi)
        hidden_states = hidden_states + attention_output
        layernorm_output = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.mlp(layernorm_output)


class GPTModel(nn.Module):
    """GPTModelPipe's stages in order: embed (no position table under ALiBi), layers,
    final layernorm, logits tied to the word embeddings."""

    def __init__(self):
        super().__init__()
        args = get_args()
        self.word_embeddings = nn.Embedding(args.padded_vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([ParallelTransformerLayer(i + 1) for i in range(args.num_layers)])
        self.final_layernorm = nn.LayerNorm(args.hidden_size)
        # init_method_normal(args.init_method_std)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=args.init_method_std)

    def forward(self, input_ids, position_ids, attention_mask):
        # position_ids are unused under ALiBi
        hidden_states = self.word_embeddings(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        hidden_states = self.final_layernorm(hidden_states)
        logits = F.linear(hidden_states, self.word_embeddings.weight)  # [s, b, v]
        return logits.transpose(0, 1).contiguous()  # [b, s, v]


# ----------------------------------------------------------------------------
# megatron/model/gpt_model.py
# ----------------------------------------------------------------------------
def get_cross_entropy(is_prefix):
    def CrossEntropy(output, labels):
        labels, loss_mask = labels[0], labels[1]
        # mpu.vocab_parallel_cross_entropy with one tensor-parallel rank (the program runs in float64)
        losses = F.cross_entropy(output.contiguous().flatten(0, 1), labels.flatten(), reduction="none")
        assert not is_prefix
        expected_number_of_tokens = loss_mask.sum()
        loss_mask = loss_mask.view(-1)
        loss = torch.sum(losses.view(-1) * loss_mask) / expected_number_of_tokens
        return loss
    return CrossEntropy


# ----------------------------------------------------------------------------
# reference: one sample alone, no packing, no padding, attention as a loop over queries
# ----------------------------------------------------------------------------
def reference_sample_logits(model, tokens, n_inputs):
    args = get_args()
    nh = args.num_attention_heads
    hn = args.hidden_size // nh
    slopes = torch.tensor(get_slopes(nh))
    length = tokens.shape[0]
    x = model.word_embeddings(tokens)  # [L, h]
    for layer in model.layers:
        attn = layer.self_attention
        h = layer.input_layernorm(x)
        q, k, v = attn.query_key_value(h).view(length, nh, 3 * hn).chunk(3, dim=-1)
        rows = []
        for i in range(length):
            keys = [j for j in range(length) if j <= i or (i < n_inputs and j < n_inputs)]
            idx = torch.tensor(keys)
            dist = (idx - i).to(torch.get_default_dtype())
            scores = torch.einsum("hd,khd->hk", q[i], k[idx]) / math.sqrt(hn) + slopes[:, None] * dist
            rows.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[idx]).reshape(-1))
        x = x + attn.dense(torch.stack(rows))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.final_layernorm(x)
    return F.linear(x, model.word_embeddings.weight)


def reference_loss(model, packed_rows):
    total, count = 0.0, 0
    for items in packed_rows:
        for it in items:
            seq = torch.from_numpy(np.concatenate([it["input_tokens"], it["target_tokens"]]))
            n_in = len(it["input_tokens"])
            logits = reference_sample_logits(model, seq[:-1], n_in)
            # position t predicts seq[t + 1]; only predictions of target tokens count
            losses = F.cross_entropy(logits[n_in - 1:], seq[n_in:], reduction="none")
            total = total + losses.sum()
            count += losses.numel()
    return total / count


def make_item(rng, n_in, n_tgt):
    tok = get_tokenizer()
    inp = rng.integers(4, get_args().padded_vocab_size, size=n_in)
    tgt = np.concatenate([rng.integers(4, get_args().padded_vocab_size, size=n_tgt - 1), [tok.eos]])
    return {"input_tokens": inp.astype(np.int64), "target_tokens": tgt.astype(np.int64)}


def main():
    args = get_args()
    tok = get_tokenizer()
    rng = np.random.default_rng(0)

    # three rows of seq_length + 1 tokens: two samples + padding, one sample + padding, three samples
    packed_rows = [
        [make_item(rng, 7, 4), make_item(rng, 5, 3)],
        [make_item(rng, 9, 6)],
        [make_item(rng, 4, 3), make_item(rng, 8, 2), make_item(rng, 3, 5)],
    ]
    dataset = DecoderPackedMTFDataset(args.seq_length + 1, tok.pad, tok.eos)
    data = default_collate([dataset.pack_samples(items) for items in packed_rows])

    model = GPTModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = get_cross_entropy(is_prefix=False)

    # --- one training step, as the pipeline engine runs it ---
    inputs, labels = get_batch_pipe(data)
    tokens, position_ids, attention_mask = inputs
    logits = model(tokens, position_ids, attention_mask)
    loss = loss_fn(logits, labels)
    optimizer.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # --- reference on the same weights ---
    ref_model = GPTModel()
    ref_model.load_state_dict(model.state_dict())
    ref = reference_loss(ref_model, packed_rows)
    ref.backward()

    # per-sample logits of every real token equal the sample run alone
    max_logit_err = 0.0
    for b, items in enumerate(packed_rows):
        start = 0
        for it in items:
            seq = torch.from_numpy(np.concatenate([it["input_tokens"], it["target_tokens"]]))
            n = len(seq)
            end = min(start + n, args.seq_length)  # the row's last token is only a label
            alone = reference_sample_logits(ref_model, seq[:end - start], len(it["input_tokens"]))
            max_logit_err = max(max_logit_err, (logits[b, start:end] - alone).abs().max().item())
            start += n
    max_grad_err = max((grads[n] - p.grad).abs().max().item() for n, p in ref_model.named_parameters())

    print(f"packed loss {loss.item():.6f}  reference loss {ref.item():.6f}")
    print(f"max |logit err| {max_logit_err:.2e}  max |grad err| {max_grad_err:.2e}")
    assert abs(loss.item() - ref.item()) < 1e-10
    assert max_logit_err < 1e-10
    assert max_grad_err < 1e-10

    optimizer.step()
    with torch.no_grad():
        loss_after = loss_fn(model(tokens, position_ids, attention_mask), labels)
    print(f"loss after one Adam step {loss_after.item():.6f}")
    print("ok")


if __name__ == "__main__":
    main()
