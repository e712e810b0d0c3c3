"""Seq2Seq-PyTorch: the LSTM decoder's SoftDotAttention softmaxes over padded source positions.

Citation: MaximumEntropy/Seq2Seq-PyTorch#6 ("question about the 'batch_mask'", closed).  The
reporters note that the mask returned by `get_minibatch()` in data_utils.py is never used by the
attention; the maintainer confirms: "You are absolutely right this means the decoder does indeed
attend to the pad tokens in the input ... You can solve this by using masked_fill with
-float('inf') in this line" (model.py, `SoftDotAttention.forward`).  Read: the issue thread and the
repository's model.py / data_utils.py (the stored model.py version I could read had been
refactored, so `SoftDotAttention` / `LSTMAttentionDot` are written after the 2017 layout the
thread points to).

Bug: `get_minibatch` pads source lines with '<pad>' and returns a `mask` (1 = real token), but
`SoftDotAttention.forward(input, context)` takes `attn = softmax(context @ W h_t)` over every
source position, so each decoder step puts weight on padded encoder states of shorter sentences.
Fix (maintainer's suggestion): pass the minibatch source mask down to the attention and do
`attn.masked_fill(ctx_mask == 0, -float('inf'))` before the softmax (the `ctx_mask` plumbing is
written here for both runs; the buggy run simply never passes the mask, as upstream).

Reproduction: `get_minibatch` on 2 source lines of length 6 and 3 (sorted, right-padded),
encoder LSTM over the padded batch, `LSTMAttentionDot` decoder unrolled over 4 target steps with
`SoftDotAttention` at each step.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def get_minibatch(lines, word2ind, index, batch_size, max_len, add_start=True, add_end=True):
    """Prepare minibatch (as in data_utils.py): input, output, lens, mask."""
    if add_start and add_end:
        lines = [['<s>'] + line + ['</s>'] for line in lines[index:index + batch_size]]
    lines = [line[:max_len] for line in lines]
    lens = [len(line) for line in lines]
    max_len = max(lens)
    input_lines = [[word2ind[w] if w in word2ind else word2ind['<unk>'] for w in line[:-1]]
                   + [word2ind['<pad>']] * (max_len - len(line)) for line in lines]
    output_lines = [[word2ind[w] if w in word2ind else word2ind['<unk>'] for w in line[1:]]
                    + [word2ind['<pad>']] * (max_len - len(line)) for line in lines]
    mask = [([1] * (l - 1)) + ([0] * (max_len - l)) for l in lens]
    return torch.LongTensor(input_lines), torch.LongTensor(output_lines), lens, torch.FloatTensor(mask)


class SoftDotAttention(nn.Module):
    """Soft Dot Attention.  Ref: http://www.aclweb.org/anthology/D15-1166"""

    def __init__(self, dim):
        super().__init__()
        self.linear_in = nn.Linear(dim, dim, bias=False)
        self.sm = nn.Softmax(dim=1)
        self.linear_out = nn.Linear(dim * 2, dim, bias=False)
        self.tanh = nn.Tanh()

    def forward(self, input, context, ctx_mask=None):
        """input: batch x dim, context: batch x sourceL x dim."""
        target = self.linear_in(input).unsqueeze(2)  # batch x dim x 1
        attn = torch.bmm(context, target).squeeze(2)  # batch x sourceL
        if ctx_mask is not None:
            attn = attn.masked_fill(ctx_mask == 0, -float('inf'))
        attn = self.sm(attn)
        attn3 = attn.view(attn.size(0), 1, attn.size(1))  # batch x 1 x sourceL
        weighted_context = torch.bmm(attn3, context).squeeze(1)  # batch x dim
        h_tilde = torch.cat((weighted_context, input), 1)
        h_tilde = self.tanh(self.linear_out(h_tilde))
        return h_tilde, attn


class LSTMAttentionDot(nn.Module):
    """A long short-term memory (LSTM) cell with attention."""

    def __init__(self, input_size, hidden_size, batch_first=True):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.batch_first = batch_first
        self.input_weights = nn.Linear(input_size, 4 * hidden_size)
        self.hidden_weights = nn.Linear(hidden_size, 4 * hidden_size)
        self.attention_layer = SoftDotAttention(hidden_size)

    def forward(self, input, hidden, ctx, ctx_mask=None):
        def recurrence(input, hidden):
            hx, cx = hidden  # n_b x hidden_dim
            gates = self.input_weights(input) + self.hidden_weights(hx)
            ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)
            ingate, forgetgate = torch.sigmoid(ingate), torch.sigmoid(forgetgate)
            cellgate, outgate = torch.tanh(cellgate), torch.sigmoid(outgate)
            cy = (forgetgate * cx) + (ingate * cellgate)
            hy = outgate * torch.tanh(cy)
            h_tilde, alpha = self.attention_layer(hy, ctx.transpose(0, 1), ctx_mask)
            return h_tilde, cy

        if self.batch_first:
            input = input.transpose(0, 1)
        output = []
        for i in range(input.size(0)):
            hidden = recurrence(input[i], hidden)
            output.append(hidden[0])
        output = torch.stack(output, 0)
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, hidden


class Seq2SeqAttention(nn.Module):
    def __init__(self, src_vocab_size, trg_vocab_size, emb_dim=8, hidden_dim=12, pad_token_src=0, pad_token_trg=0):
        super().__init__()
        self.src_embedding = nn.Embedding(src_vocab_size, emb_dim, pad_token_src)
        self.trg_embedding = nn.Embedding(trg_vocab_size, emb_dim, pad_token_trg)
        self.encoder = nn.LSTM(emb_dim, hidden_dim, 1, batch_first=True)
        self.decoder = LSTMAttentionDot(emb_dim, hidden_dim, batch_first=True)
        self.encoder2decoder = nn.Linear(hidden_dim, hidden_dim)
        self.decoder2vocab = nn.Linear(hidden_dim, trg_vocab_size)

    def forward(self, input_src, input_trg, ctx_mask=None):
        src_emb = self.src_embedding(input_src)
        trg_emb = self.trg_embedding(input_trg)
        src_h, (src_h_t, src_c_t) = self.encoder(src_emb)
        h_t, c_t = src_h_t[-1], src_c_t[-1]
        decoder_init_state = torch.tanh(self.encoder2decoder(h_t))
        ctx = src_h.transpose(0, 1)
        trg_h, (_, _) = self.decoder(trg_emb, (decoder_init_state, c_t), ctx, ctx_mask)
        return self.decoder2vocab(trg_h)


def main():
    torch.manual_seed(0)
    src_vocab = {w: i for i, w in enumerate(['<pad>', '<unk>', '<s>', '</s>', 'le', 'chat', 'est', 'sur', 'la', 'table'])}
    trg_vocab = {w: i for i, w in enumerate(['<pad>', '<unk>', '<s>', '</s>', 'the', 'cat', 'is', 'here'])}
    src_lines = [['le', 'chat', 'est', 'sur', 'la', 'table'], ['le', 'chat']]
    trg_lines = [['the', 'cat', 'is'], ['the', 'cat']]
    input_lines_src, _, lens_src, mask_src = get_minibatch(src_lines, src_vocab, 0, 2, 10, add_start=True, add_end=True)
    input_lines_trg, _, _, _ = get_minibatch(trg_lines, trg_vocab, 0, 2, 10, add_start=True, add_end=True)
    model = Seq2SeqAttention(len(src_vocab), len(trg_vocab)).eval()
    with torch.no_grad():
        if FIXED:
            decoder_logit = model(input_lines_src, input_lines_trg, ctx_mask=mask_src)
        else:
            # mask_src is computed by get_minibatch but never handed to the model
            decoder_logit = model(input_lines_src, input_lines_trg)
    print("argmax", decoder_logit.argmax(-1).tolist(), "sum", round(decoder_logit.sum().item(), 4))


if __name__ == "__main__":
    main()
