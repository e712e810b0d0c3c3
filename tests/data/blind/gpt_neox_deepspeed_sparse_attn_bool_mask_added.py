# EleutherAI/gpt-neox#139 (merge 9aa26f98): "Fix sparsity"
# The sparse layers hand Megatron's boolean causal mask (True = masked, from `attention_mask < 0.5`) straight to
# DeepSpeed's SparseSelfAttention built with attn_mask_mode='add'. DeepSpeed casts it to the query dtype and adds it
# to the scores, so future keys get +1.0 instead of being masked: inside each block-causal diagonal block of the
# 'unidirectional' VariableSparsityConfig layout, tokens attend to later tokens. The fix passes
# `attention_mask.to(query_layer.dtype) * -10000` instead.
# Ported from megatron/model/transformer.py (ParallelSelfAttention, sparse branch) and megatron/utils.py
# (get_ltor_masks_and_position_ids) at 9aa26f98^1, single partition (plain nn.Linear for the mpu layers), and
# deepspeed/ops/sparse_attention (SparseSelfAttention, VariableSparsityConfig); the Triton block-sparse
# sdd-matmul / softmax / dsd-matmul are computed densely with the layout's missing blocks left out of the softmax.
import sys
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

# ---------------------------------------------------------------- deepspeed.ops.sparse_attention

class SparsityConfig:
    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len):
        if (seq_len % self.block != 0):
            raise ValueError(f'Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!')
        num_blocks = seq_len // self.block
        layout = torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)
        return layout

    def check_and_propagate_first_head_layout(self, layout):
        if not self.different_layout_per_head:
            layout[1:self.num_heads, :, :] = layout[0, :, :]
        return layout


class VariableSparsityConfig(SparsityConfig):
    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_random_blocks=0,
                 local_window_blocks=[4],
                 global_block_indices=[0],
                 global_block_end_indices=None,
                 attention='bidirectional',
                 horizontal_global_attention=False):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = local_window_blocks
        self.global_block_indices = global_block_indices
        self.global_block_end_indices = global_block_end_indices
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h, layout):
        num_blocks = layout.shape[1]
        for row in range(0, num_blocks):
            rnd_cols = random.sample(range(0, num_blocks), self.num_random_blocks)
            layout[h, row, rnd_cols] = 1
        return layout

    def set_local_layout(self, h, layout):
        num_blocks = layout.shape[1]
        start_block_idx = 0
        end_block_idx = 0
        for block_size in self.local_window_blocks:
            end_block_idx += block_size
            end_block_idx = min(end_block_idx, num_blocks)
            for row in range(start_block_idx, end_block_idx):
                for col in range(start_block_idx, (row + 1 if self.attention == 'unidirectional' else end_block_idx)):
                    layout[h, row, col] = 1
            start_block_idx += block_size

        for i in range(start_block_idx, num_blocks, block_size):
            end_block_idx = min(i + block_size, num_blocks)
            for row in range(i, end_block_idx):
                for col in range(i, (row + 1 if self.attention == 'unidirectional' else end_block_idx)):
                    layout[h, row, col] = 1
        return layout

    def set_global_layout(self, h, layout):
        num_blocks = layout.shape[1]
        for idx in self.global_block_indices:
            if (idx < num_blocks):
                if (self.horizontal_global_attention):
                    layout[h, idx, :] = 1
                first_row = 0 if self.attention == 'bidirectional' else idx
                layout[h, first_row:, idx] = 1
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(0, self.num_layout_heads):
            layout = self.set_random_layout(h, layout)
            layout = self.set_local_layout(h, layout)
            layout = self.set_global_layout(h, layout)
        layout = self.check_and_propagate_first_head_layout(layout)
        return layout


def block_sparse_softmax(x, layout, block, scale, attn_mask, attn_mask_mode):
    # what the Triton Softmax does on the blocks present in `layout`: x * scale, then the attn mask
    # (added as is for 'add', where(mask == 0, -inf, 0) for 'mul'); blocks absent from the layout are never computed
    x = x * scale
    if attn_mask is not None:
        if attn_mask_mode == 'mul':
            attn_mask = torch.where(attn_mask == 0, float('-inf'), 0.).to(x.dtype)
        x = x + attn_mask
    present = layout.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1).bool()
    x = x.masked_fill(~present, float('-inf'))
    return torch.softmax(x, dim=-1)


class SparseSelfAttention(nn.Module):
    def __init__(self, sparsity_config, key_padding_mask_mode='add', attn_mask_mode='mul', max_seq_length=2048):
        super().__init__()
        self.sparsity_config = sparsity_config
        master_layout = self.sparsity_config.make_layout(max_seq_length)
        self.register_buffer("master_layout", master_layout)
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.last_attn_weights = None

    def get_layout(self, L):
        num_blocks = L // self.sparsity_config.block
        return self.master_layout[..., :num_blocks, :num_blocks].cpu()

    def transpose_mask_for_sparse(self, qtype, x, is_key_padding_mask=False):
        x = x.type(qtype)
        if is_key_padding_mask:
            xdim = x.dim()
            for d in range(xdim - 1, 0, -1):
                x = x.squeeze(dim=d)
            return x
        return x.squeeze()

    def forward(self, query, key, value, rpe=None, key_padding_mask=None, attn_mask=None):
        bsz, num_heads, tgt_len, head_dim = query.size()

        if attn_mask is not None:
            attn_mask = self.transpose_mask_for_sparse(query.dtype, attn_mask)

        layout = self.get_layout(tgt_len)
        scaling = float(head_dim)**-0.5

        attn_output_weights = torch.matmul(query, key.transpose(-1, -2))             # sparse_dot_sdd_nt
        attn_output_weights = block_sparse_softmax(attn_output_weights, layout, self.sparsity_config.block,
                                                   scaling, attn_mask, self.attn_mask_mode)
        self.last_attn_weights = attn_output_weights.detach()
        attn_output = torch.matmul(attn_output_weights, value)                      # sparse_dot_dsd_nn
        return attn_output

# ---------------------------------------------------------------- megatron

class Args:
    hidden_size = 64
    num_attention_heads = 4
    seq_length = 64
    num_layers = 2
    sparsity = 'all'
    padded_vocab_size = 128
    max_position_embeddings = 64


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Build masks and position id for left to right model."""
    batch_size, seq_length = data.size()

    if reset_attention_mask:
        att_mask_batch = batch_size
    else:
        att_mask_batch = 1
    attention_mask = torch.tril(torch.ones(
        (att_mask_batch, seq_length, seq_length), device=data.device)).view(
        att_mask_batch, 1, seq_length, seq_length)

    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0

    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)

    # Convert attention mask to binary:
    attention_mask = (attention_mask < 0.5)

    return attention_mask, loss_mask, position_ids


class ParallelSelfAttention(nn.Module):
    def __init__(self, args, layer_number, sparse=False):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.hidden_size_per_partition = args.hidden_size
        self.hidden_size_per_attention_head = args.hidden_size // args.num_attention_heads
        self.num_attention_heads_per_partition = args.num_attention_heads

        self.query_key_value = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)

        self.sparse = sparse
        if self.sparse:
            sparsity_config = VariableSparsityConfig(
                num_heads=args.num_attention_heads,
                attention="unidirectional"
            )

            self.sparse_attn = SparseSelfAttention(
                sparsity_config=sparsity_config,
                max_seq_length=args.seq_length,
                attn_mask_mode='add')

        self.dense = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, hidden_states, attention_mask):
        # hidden_states: [sq, b, h]
        mixed_x_layer = self.query_key_value(hidden_states)

        # [sq, b, (np * 3 * hn)] --> [sq, b, np, 3 * hn]
        new_tensor_shape = mixed_x_layer.size()[:-1] + \
                           (self.num_attention_heads_per_partition,
                            3 * self.hidden_size_per_attention_head)
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)

        # [sq, b, np, 3 * hn] --> 3 [sq, b, np, hn]
        (query_layer, key_layer, value_layer) = torch.chunk(mixed_x_layer, 3, dim=-1)

        # shape of q/k/v is [sq, b, np, hn] and needs to be transposed to [b, np, sq, hn]
        query_layer, key_layer, value_layer = map(lambda t: t.permute(1, 2, 0, 3).contiguous(),
                                                  (query_layer, key_layer, value_layer))
        # output shape [b, np(heads), sq, hn]
        if FIXED:
            attn_mask = attention_mask.to(query_layer.dtype) * -10000
            context_layer = self.sparse_attn(query_layer, key_layer, value_layer, attn_mask=attn_mask)
        else:
            context_layer = self.sparse_attn(query_layer, key_layer, value_layer, attn_mask=attention_mask)

        # [b, np, sq, hn] --> [sq, b, np, hn]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()

        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
        context_layer = context_layer.view(*new_context_layer_shape)

        return self.dense(context_layer)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, args, layer_number, sparse=False):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(args.hidden_size)
        self.attention = ParallelSelfAttention(args, layer_number, sparse=sparse)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, 4 * args.hidden_size), nn.GELU(),
                                 nn.Linear(4 * args.hidden_size, args.hidden_size))

    def forward(self, hidden_states, attention_mask):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.attention(layernorm_output, attention_mask)
        layernorm_input = hidden_states + attention_output
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        return layernorm_input + self.mlp(layernorm_output)


class GPT2Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.padded_vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)

        def build_layer(layer_number):
            if args.sparsity == 'none':
                sparse = False
            elif args.sparsity == 'all':
                sparse = True
            elif args.sparsity == 'interspersed':
                sparse = not layer_number % 2 == 0
            return ParallelTransformerLayer(args, layer_number, sparse=sparse)

        self.layers = nn.ModuleList([build_layer(i + 1) for i in range(args.num_layers)])
        self.final_layernorm = nn.LayerNorm(args.hidden_size)
        for p in self.parameters():            # init_method_normal(0.02)
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids, position_ids, attention_mask):
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        hidden_states = embeddings.transpose(0, 1).contiguous()      # [b, s, h] -> [s, b, h]
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        hidden_states = self.final_layernorm(hidden_states).transpose(0, 1)
        return F.linear(hidden_states, self.word_embeddings.weight)


def get_batch(tokens_):
    tokens = tokens_[:, :-1].contiguous()
    labels = tokens_[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token=0, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    return tokens, labels, loss_mask, attention_mask, position_ids


if __name__ == '__main__':
    torch.manual_seed(0)
    random.seed(0)
    args = Args()
    model = GPT2Model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # pretrain_gpt2.forward_step: one training step
    data = torch.randint(1, args.padded_vocab_size, (2, args.seq_length + 1))
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data)
    logits = model(tokens, position_ids, attention_mask)
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction='none')
    loss = torch.sum(losses * loss_mask.view(-1)) / loss_mask.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f'lm loss: {loss.item():.4f}')

    # how much attention probability lands on future tokens (layer 1)
    w = model.layers[0].attention.sparse_attn.last_attn_weights
    future = torch.ones(args.seq_length, args.seq_length).triu(1).bool()
    print(f'attention mass on future keys, layer 1 (mean over queries): {w.masked_fill(~future, 0).sum(-1).mean().item():.4f}')
