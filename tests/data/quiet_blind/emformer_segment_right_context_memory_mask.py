"""Emformer streaming speech encoder (pytorch/audio torchaudio/models/emformer.py), full-utterance training pass.

Follows Emformer._gen_right_context / _gen_attention_mask / _gen_attention_mask_col_widths and
_EmformerAttention (query = [right_context, utterance, summary], key = [mems, right_context, utterance],
bool mask filled with negative_inf=-1e8, plus a key padding mask from `lengths`). Written as a compact
re-implementation with the same names and the same block layout of the mask. The mask it means, for segment s (segment_length=4,
left_context_length=2, right_context_length=2, max_memory_size=2):
  * right-context rows and utterance rows of s see: memory vectors of the <= 2 previous segments, the
    right-context copy that belongs to s (look-ahead frames), and utterance frames from 2 frames before s
    up to the end of s - bidirectional inside the segment, no frames of later segments;
  * the summary row of s (which becomes the memory for later segments) sees s's right context and
    s's utterance window, but no memory;
  * frames past an utterance's length are hidden as keys, both in the utterance and in the
    right-context copies (upstream's klengths mask only hides the utterance tail and would let a real
    frame read a padded look-ahead frame; this program hides those copies as well).
So the same frame is visible to one query and hidden from the next one in a blockwise, non-causal
pattern - that is the streaming contract (latency = segment + right context).
"""
import math

import torch
import torch.nn as nn


def _lengths_to_padding_mask(frame_index, lengths):
    """True where the frame a key was taken from lies past that utterance's length."""
    return frame_index.unsqueeze(0) >= lengths.unsqueeze(1)


class _EmformerAttention(nn.Module):
    def __init__(self, input_dim, num_heads, negative_inf=-1e8):
        super().__init__()
        self.input_dim, self.num_heads, self.negative_inf = input_dim, num_heads, negative_inf
        self.scaling = (input_dim // num_heads) ** -0.5
        self.emb_to_key_value = nn.Linear(input_dim, 2 * input_dim)
        self.emb_to_query = nn.Linear(input_dim, input_dim)
        self.out_proj = nn.Linear(input_dim, input_dim)

    def forward(self, utterance, key_padding_mask, right_context, summary, mems, attention_mask):
        B = utterance.size(1)
        T = right_context.size(0) + utterance.size(0) + summary.size(0)
        query = self.emb_to_query(torch.cat([right_context, utterance, summary]))
        key, value = self.emb_to_key_value(torch.cat([mems, right_context, utterance])).chunk(2, dim=2)
        hd = self.input_dim // self.num_heads
        q, k, v = [t.contiguous().view(-1, B * self.num_heads, hd).transpose(0, 1) for t in (query, key, value)]
        weights = torch.bmm(q * self.scaling, k.transpose(1, 2)).float()
        weights = weights.masked_fill(attention_mask.unsqueeze(0), self.negative_inf)
        if key_padding_mask is not None:
            weights = weights.view(B, self.num_heads, T, -1).masked_fill(key_padding_mask[:, None, None, :], self.negative_inf)
            weights = weights.view(B * self.num_heads, T, -1)
        probs = torch.softmax(weights, dim=-1)
        out = torch.bmm(probs, v).transpose(0, 1).contiguous().view(T, B, self.input_dim)
        out = self.out_proj(out)
        s = summary.size(0)
        return out[: T - s], torch.clamp(out[T - s:], min=-10, max=10)[:-1]


class _EmformerLayer(nn.Module):
    def __init__(self, input_dim, num_heads, ffn_dim, segment_length, max_memory_size):
        super().__init__()
        self.attention = _EmformerAttention(input_dim, num_heads)
        self.memory_op = nn.AvgPool1d(kernel_size=segment_length, stride=segment_length, ceil_mode=True)
        self.pos_ff = nn.Sequential(nn.LayerNorm(input_dim), nn.Linear(input_dim, ffn_dim), nn.ReLU(), nn.Linear(ffn_dim, input_dim))
        self.layer_norm_input = nn.LayerNorm(input_dim)
        self.layer_norm_output = nn.LayerNorm(input_dim)
        self.use_mem = max_memory_size > 0

    def forward(self, utterance, key_padding_mask, right_context, mems, attention_mask):
        R = right_context.size(0)
        normed = self.layer_norm_input(torch.cat([right_context, utterance]))
        ln_rc, ln_utt = normed[:R], normed[R:]
        summary = self.memory_op(ln_utt.permute(1, 2, 0)).permute(2, 0, 1) if self.use_mem else ln_utt[:0]
        rc_output, next_mems = self.attention(ln_utt, key_padding_mask, ln_rc, summary, mems, attention_mask)
        result = rc_output + torch.cat([right_context, utterance])
        result = self.layer_norm_output(self.pos_ff(result) + result)
        return result[R:], result[:R], next_mems


class Emformer(nn.Module):
    def __init__(self, input_dim, num_heads, ffn_dim, num_layers, left_context_length=0, right_context_length=0,
                 segment_length=128, max_memory_size=0):
        super().__init__()
        self.left_context_length, self.right_context_length = left_context_length, right_context_length
        self.segment_length, self.max_memory_size = segment_length, max_memory_size
        self.use_mem = max_memory_size > 0
        self.memory_op = nn.AvgPool1d(kernel_size=segment_length, stride=segment_length, ceil_mode=True)
        self.emformer_layers = nn.ModuleList([
            _EmformerLayer(input_dim, num_heads, ffn_dim, segment_length, max_memory_size) for _ in range(num_layers)])

    def _right_context_frame_index(self, T):
        num_segs = math.ceil((T - self.right_context_length) / self.segment_length)
        starts = [(i + 1) * self.segment_length for i in range(num_segs - 1)] + [T - self.right_context_length]
        return torch.cat([torch.arange(st, st + self.right_context_length) for st in starts])

    def _gen_right_context(self, input):
        """The right_context_length frames after each segment, copied as extra look-ahead queries/keys."""
        T = input.shape[0]
        num_segs = math.ceil((T - self.right_context_length) / self.segment_length)
        blocks = [input[(i + 1) * self.segment_length:(i + 1) * self.segment_length + self.right_context_length]
                  for i in range(num_segs - 1)]
        blocks.append(input[T - self.right_context_length:])
        return torch.cat(blocks)

    def _gen_attention_mask(self, utterance):
        """Bool mask, True = blocked, rows [rc blocks, utterance, summaries], cols [mems, rc blocks, utterance]."""
        U = utterance.shape[0]
        S, R, LC, M = self.segment_length, self.right_context_length, self.left_context_length, self.max_memory_size
        num_segs = math.ceil(U / S)
        n_mem = num_segs - 1 if self.use_mem else 0
        n_cols = n_mem + num_segs * R + U
        rows = []
        for seg in range(num_segs):
            allowed = torch.zeros(n_cols, dtype=torch.bool)
            seg_start, seg_end = max(seg * S - LC, 0), min((seg + 1) * S, U)
            rc_cols = slice(n_mem + seg * R, n_mem + (seg + 1) * R)
            utt_cols = slice(n_mem + num_segs * R + seg_start, n_mem + num_segs * R + seg_end)
            allowed[rc_cols] = True
            allowed[utt_cols] = True
            with_mem = allowed.clone()
            if self.use_mem:
                with_mem[max(seg - M, 0):seg] = True
            rows.append(("rc", seg, with_mem.expand(R, -1)))
            rows.append(("utt", seg, with_mem.expand(seg_end - seg * S, -1)))
            rows.append(("sum", seg, allowed.expand(1 if self.use_mem else 0, -1)))
        order = {"rc": 0, "utt": 1, "sum": 2}
        rows.sort(key=lambda r: (order[r[0]], r[1]))
        return ~torch.cat([r[2] for r in rows])

    def forward(self, input, lengths):
        input = input.permute(1, 0, 2)  # (T, B, D)
        right_context = self._gen_right_context(input)
        utterance = input[: input.size(0) - self.right_context_length]
        attention_mask = self._gen_attention_mask(utterance)
        mems = self.memory_op(utterance.permute(1, 2, 0)).permute(2, 0, 1)[:-1] if self.use_mem else utterance[:0]
        # key order [mems, right context blocks, utterance]; memory vectors are never padding
        key_frames = torch.cat([torch.full((mems.size(0),), -1), self._right_context_frame_index(input.size(0)),
                                torch.arange(utterance.size(0))])
        key_padding_mask = _lengths_to_padding_mask(key_frames, lengths)
        output = utterance
        for layer in self.emformer_layers:
            output, right_context, mems = layer(output, key_padding_mask, right_context, mems, attention_mask)
        return output.permute(1, 0, 2), lengths


def main():
    torch.manual_seed(0)
    emformer = Emformer(input_dim=32, num_heads=4, ffn_dim=64, num_layers=2, left_context_length=2,
                        right_context_length=2, segment_length=4, max_memory_size=2).eval()
    # RNNT recipe: features right-padded with right_context_length frames; lengths count real frames
    input = torch.randn(2, 14 + 2, 32)
    lengths = torch.tensor([14, 9])
    with torch.no_grad():
        output, out_lengths = emformer(input, lengths)
    print("encoded", tuple(output.shape), out_lengths.tolist(), f"{output[1, :9].abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
