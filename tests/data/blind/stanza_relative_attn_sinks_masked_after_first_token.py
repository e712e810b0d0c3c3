# Citation: stanfordnlp/stanza commit 5cb52f32 ("The sinks were being masked away for tokens after 1.
#   This should fix that error"), fixing the attention sinks added in commit 415e4c61.
# Upstream: stanza/models/common/relative_attn.py, RelativeAttention (__init__ mask / flipped_mask
#   buffers, forward, skew_repeat); used by stanza/models/constituency/lstm_model.py (rattn forward +
#   reverse over each sentence's word inputs, summed when rattn_cat is off).
# Bug: the windowed (relative) attention mask was built as tril(window + num_sinks) and the sinks were
#   prepended to the sequence and skewed like ordinary positions, so the sink slots fell out of every
#   token's window except the first: tokens after the first could not attend to the sinks.
# Fix: the mask is built over the window only; the sinks are kept as their own rows in front of the
#   skewed window (skew_repeat puts q_sink / v_sink rows first), and keys skip the sink positions, so
#   every token attends to the sinks plus its window.
import sys

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class RelativeAttention(nn.Module):
    def __init__(self, d_model, num_heads, window=8, dropout=0.2, reverse=False, d_output=None, fudge_output=False, num_sinks=0):
        super().__init__()
        if d_output is None:
            d_output = d_model

        d_head, remainder = divmod(d_output, num_heads)
        if remainder:
            if fudge_output:
                d_head = d_head + 1
                d_output = num_heads * d_head
            else:
                raise ValueError("incompatible `d_model` and `num_heads`")
        self.window = window
        self.num_sinks = num_sinks
        self.d_model = d_model
        self.d_head = d_head
        self.num_heads = num_heads
        self.d_output = d_output
        self.key = nn.Linear(d_model, d_output)
        self.query = nn.Linear(d_model, d_output, bias=False)
        self.value = nn.Linear(d_model, d_output, bias=False)

        self.dropout = nn.Dropout(dropout)
        self.position = nn.Parameter(torch.randn(1, 1, d_head, window + num_sinks, 1))

        if FIXED:
            mask_size = window
        else:
            mask_size = window + num_sinks
        self.register_buffer(
            "mask",
            torch.tril(torch.ones(mask_size, mask_size), diagonal=-1).unsqueeze(0).unsqueeze(0).unsqueeze(0)
        )
        self.register_buffer(
            "flipped_mask",
            torch.flip(self.mask, (-1,))
        )

        self.reverse = reverse

    def forward(self, x):
        if FIXED:
            return self._forward_fixed(x)
        return self._forward_orig(x)

    def _forward_orig(self, x):
        # x.shape == (batch_size, seq_len, d_model)
        batch_size, seq_len, d_model = x.shape
        if d_model != self.d_model:
            raise ValueError("Incompatible input")

        if self.reverse:
            x = torch.flip(x, (1,))

        orig_seq_len = seq_len
        if seq_len < self.window:
            zeros = torch.zeros((x.shape[0], self.window - seq_len, x.shape[2]), dtype=x.dtype, device=x.device)
            x = torch.cat((x, zeros), axis=1)
            seq_len = self.window

        if self.num_sinks > 0:
            orig_seq_len += self.num_sinks
            seq_len += self.num_sinks
            sink = torch.zeros((batch_size, self.num_sinks, d_model), dtype=x.dtype, device=x.device)
            x = torch.cat((sink, x), axis=1)

        # k.shape = (batch_size, num_heads, d_head, seq_len)
        k = self.key(x).reshape(batch_size, seq_len, self.num_heads, -1).permute(0, 2, 3, 1)
        # v.shape = (batch_size, num_heads, d_head, seq_len)
        v = self.value(x).reshape(batch_size, seq_len, self.num_heads, -1).permute(0, 2, 3, 1)
        # q.shape = (batch_size, num_heads, d_head, seq_len)
        q = self.query(x).reshape(batch_size, seq_len, self.num_heads, -1).permute(0, 2, 3, 1)
        # q.shape = (batch_size, num_heads, d_head, window, seq_len)
        q = self.skew_repeat(q)
        q = q + self.position

        # qk.shape = (batch_size, num_heads, d_head, window, seq_len)
        qk = torch.einsum('bndws,bnds->bndws', q, k)

        # mask out the padding spaces at the end
        if orig_seq_len < seq_len:
            shorter_mask = self.flipped_mask[:, :, :, :, -orig_seq_len:]
            qk[:, :, :, :, :orig_seq_len] = qk[:, :, :, :, :orig_seq_len].masked_fill(shorter_mask == 1, float("-inf"))
            qk = qk[:, :, :, :orig_seq_len, :orig_seq_len]
        else:
            qk[:, :, :, :, -(self.window + self.num_sinks):] = qk[:, :, :, :, -(self.window + self.num_sinks):].masked_fill(self.flipped_mask == 1, float("-inf"))
        qk = F.softmax(qk, dim=3)

        v = self.skew_repeat(v)
        if orig_seq_len < seq_len:
            v = v[:, :, :, :orig_seq_len, :orig_seq_len]
        result = torch.einsum('bndws,bndws->bnds', qk, v)
        result = result.reshape(batch_size, self.d_output, orig_seq_len).transpose(1, 2)

        if self.reverse:
            result = torch.flip(result, (1,))

        return self.dropout(result[:, self.num_sinks:, :])

    def _forward_fixed(self, x):
        # x.shape == (batch_size, seq_len, d_model)
        batch_size, seq_len, d_model = x.shape
        if d_model != self.d_model:
            raise ValueError("Incompatible input")

        if self.reverse:
            x = torch.flip(x, (1,))

        orig_seq_len = seq_len
        if seq_len < self.window:
            zeros = torch.zeros((x.shape[0], self.window - seq_len, x.shape[2]), dtype=x.dtype, device=x.device)
            x = torch.cat((x, zeros), axis=1)
            seq_len = self.window

        if self.num_sinks > 0:
            sink = torch.zeros((batch_size, self.num_sinks, d_model), dtype=x.dtype, device=x.device)
            x = torch.cat((sink, x), axis=1)

        # k.shape = (batch_size, num_heads, d_head, seq_len + num_sinks)
        k = self.key(x).reshape(batch_size, seq_len + self.num_sinks, self.num_heads, -1).permute(0, 2, 3, 1)[:, :, :, self.num_sinks:]
        # v.shape = (batch_size, num_heads, d_head, seq_len + num_sinks)
        v = self.value(x).reshape(batch_size, seq_len + self.num_sinks, self.num_heads, -1).permute(0, 2, 3, 1)
        # q.shape = (batch_size, num_heads, d_head, seq_len + num_sinks)
        q = self.query(x).reshape(batch_size, seq_len + self.num_sinks, self.num_heads, -1).permute(0, 2, 3, 1)
        # q.shape = (batch_size, num_heads, d_head, window + num_sinks, seq_len)
        q = self.skew_repeat(q)
        q = q + self.position

        # qk.shape = (batch_size, num_heads, d_head, window + num_sinks, seq_len)
        qk = torch.einsum('bndws,bnds->bndws', q, k)

        # mask out the padding spaces at the end
        if orig_seq_len < seq_len:
            shorter_mask = self.flipped_mask[:, :, :, :orig_seq_len, -orig_seq_len:]
            qk = qk[:, :, :, :(orig_seq_len + self.num_sinks), :orig_seq_len]
            qk[:, :, :, -orig_seq_len:, :] = qk[:, :, :, -orig_seq_len:, :].masked_fill(shorter_mask == 1, float("-inf"))
        else:
            qk[:, :, :, -self.window:, -self.window:] = qk[:, :, :, -self.window:, -self.window:].masked_fill(self.flipped_mask == 1, float("-inf"))
        qk = F.softmax(qk, dim=3)

        v = self.skew_repeat(v)
        if orig_seq_len < seq_len:
            v = v[:, :, :, :(orig_seq_len + self.num_sinks), :orig_seq_len]
        result = torch.einsum('bndws,bndws->bnds', qk, v)
        result = result.reshape(batch_size, self.d_output, orig_seq_len).transpose(1, 2)

        if self.reverse:
            result = torch.flip(result, (1,))

        return self.dropout(result)

    def skew_repeat(self, q):
        if not FIXED:
            total_window = self.window + self.num_sinks
            q = q.unsqueeze(4).repeat(1, 1, 1, 1, total_window).transpose(3, 4)
            q[:, :, :, :, :total_window] = q[:, :, :, :, :total_window].masked_fill(self.mask == 1, 0)
            q_new_shape = list(q.shape)[:-2] + [-1]
            q = q.reshape(q_new_shape)
            zeros = torch.zeros_like(q[:, :, :, :1])
            zeros = zeros.repeat(1, 1, 1, total_window)
            q = torch.cat((q, zeros), axis=-1)
            q_new_shape = q_new_shape[:-1] + [total_window, -1]
            q = q.reshape(q_new_shape)[:, :, :, :, :-1]
            return q

        if self.num_sinks > 0:
            q_sink = q[:, :, :, :self.num_sinks]
            q_sink = q_sink.unsqueeze(4)
            q_sink = q_sink.repeat(1, 1, 1, 1, q.shape[-1] - self.num_sinks)
            q = q[:, :, :, self.num_sinks:]
        q = q.unsqueeze(4).repeat(1, 1, 1, 1, self.window).transpose(3, 4)
        q[:, :, :, :, :self.window] = q[:, :, :, :, :self.window].masked_fill(self.mask == 1, 0)
        q_new_shape = list(q.shape)[:-2] + [-1]
        q = q.reshape(q_new_shape)
        zeros = torch.zeros_like(q[:, :, :, :1])
        zeros = zeros.repeat(1, 1, 1, self.window)
        q = torch.cat((q, zeros), axis=-1)
        q_new_shape = q_new_shape[:-1] + [self.window, -1]
        q = q.reshape(q_new_shape)[:, :, :, :, :-1]
        if self.num_sinks > 0:
            q = torch.cat([q_sink, q], dim=3)
        return q


class RattnBlock(nn.Module):
    """The rattn part of LSTMModel.forward (rattn_forward + rattn_reverse, rattn_cat off) and its word LSTM."""
    def __init__(self, word_input_size, heads, window, sinks, hidden):
        super().__init__()
        self.rel_attn_forward = RelativeAttention(word_input_size, heads, window=window, num_sinks=sinks)
        self.rel_attn_reverse = RelativeAttention(word_input_size, heads, window=window, reverse=True, num_sinks=sinks)
        self.word_lstm = nn.LSTM(word_input_size, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, 5)

    def forward(self, all_word_inputs):
        rattn_inputs = [[x] for x in all_word_inputs]
        rattn_inputs = [x + [self.rel_attn_forward(x[0].unsqueeze(0)).squeeze(0)] for x in rattn_inputs]
        rattn_inputs = [x + [self.rel_attn_reverse(x[0].unsqueeze(0)).squeeze(0)] for x in rattn_inputs]
        rattn_inputs = [torch.stack(x, axis=2) for x in rattn_inputs]
        all_word_inputs = [torch.sum(x, axis=2) for x in rattn_inputs]
        packed = torch.nn.utils.rnn.pack_sequence(all_word_inputs, enforce_sorted=False)
        word_output, _ = self.word_lstm(packed)
        word_output, lengths = torch.nn.utils.rnn.pad_packed_sequence(word_output, batch_first=True)
        return self.out(word_output), lengths


def main():
    torch.manual_seed(0)
    d_model, heads, window, sinks = 16, 4, 3, 1
    block = RattnBlock(d_model, heads, window, sinks, hidden=8)
    block.eval()
    # a few "sentences" of word inputs (as the constituency parser hands them over), some shorter than the window
    lengths = [7, 5, 2, 9]
    sentences = [torch.randn(n, d_model) for n in lengths]
    targets = [torch.randint(0, 5, (n,)) for n in lengths]
    with torch.no_grad():
        fwd = block.rel_attn_forward(sentences[0].unsqueeze(0)).squeeze(0)
        logits, out_lengths = block(sentences)
    loss = 0.0
    for i, n in enumerate(out_lengths.tolist()):
        loss = loss + F.cross_entropy(logits[i, :n], targets[i])
    loss = loss / len(lengths)
    print("rel_attn_forward sentence 0, first 3 tokens:", [round(v, 4) for v in fwd[:3].sum(-1).tolist()])
    print("output lengths:", out_lengths.tolist())
    print("logits sum per sentence:", [round(logits[i, :n].sum().item(), 4) for i, n in enumerate(out_lengths.tolist())])
    print("loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
