"""SenseVoice-Small (FunAudioLLM/SenseVoice model.py): SANM encoder over padded fbank frames.

Ported (tiny sizes, no funasr import) from FunAudioLLM/SenseVoice @d478f77b134c50a12e2a77e35a4cea3a6e12901d model.py:
  * SenseVoiceSmall.inference: four query embeddings (language, event, emotion, text-norm) are
    PREPENDED to the fbank frames and speech_lengths += 4 (1 + 3), so padding stays on the right.
  * SenseVoiceEncoderSmall.forward: masks = sequence_mask(ilens)[:, None, :] (float, 1 = real frame).
  * MultiHeadedAttentionSANM.forward_fsmn: the FSMN memory (depthwise Conv1d over V) multiplies its
    input AND its output by the mask, so padded frames never leak into real ones through the conv.
  * MultiHeadedAttentionSANM.forward_attention: mask.unsqueeze(1).eq(0), scores.masked_fill(-inf),
    softmax, then masked_fill(mask, 0.0). The mask is key-only (B, 1, 1, T): padded *query* rows
    still see the real keys, so no row is ever fully masked.
  * CTC greedy decode over the first encoder_out_lens[i] frames.
Check: the padded batch must equal each utterance run alone without padding.
"""
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


class SinusoidalPositionEncoder(nn.Module):
    def encode(self, positions, depth, dtype=torch.float32):
        batch_size = positions.size(0)
        positions = positions.type(dtype)
        log_timescale_increment = torch.log(torch.tensor([10000], dtype=dtype)) / (depth / 2 - 1)
        inv_timescales = torch.exp(torch.arange(depth / 2).type(dtype) * (-log_timescale_increment))
        inv_timescales = torch.reshape(inv_timescales, [batch_size, -1])
        scaled_time = torch.reshape(positions, [1, -1, 1]) * torch.reshape(inv_timescales, [1, 1, -1])
        encoding = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=2)
        return encoding.type(dtype)

    def forward(self, x):
        batch_size, timesteps, input_dim = x.size()
        positions = torch.arange(1, timesteps + 1, device=x.device)[None, :]
        return x + self.encode(positions, input_dim, x.dtype)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim, hidden_units):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, x):
        return self.w_2(torch.relu(self.w_1(x)))


class MultiHeadedAttentionSANM(nn.Module):
    def __init__(self, n_head, in_feat, n_feat, kernel_size, sanm_shfit=0):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_q_k_v = nn.Linear(in_feat, n_feat * 3)
        self.fsmn_block = nn.Conv1d(n_feat, n_feat, kernel_size, stride=1, padding=0, groups=n_feat, bias=False)
        left_padding = (kernel_size - 1) // 2
        if sanm_shfit > 0:
            left_padding = left_padding + sanm_shfit
        right_padding = kernel_size - 1 - left_padding
        self.pad_fn = nn.ConstantPad1d((left_padding, right_padding), 0.0)

    def forward_fsmn(self, inputs, mask):
        b, t, d = inputs.size()
        if mask is not None:
            mask = torch.reshape(mask, (b, -1, 1))
            inputs = inputs * mask
        x = inputs.transpose(1, 2)
        x = self.pad_fn(x)
        x = self.fsmn_block(x)
        x = x.transpose(1, 2)
        x += inputs
        if mask is not None:
            x = x * mask
        return x

    def forward_qkv(self, x):
        b, t, d = x.size()
        q_k_v = self.linear_q_k_v(x)
        q, k, v = torch.split(q_k_v, int(self.h * self.d_k), dim=-1)
        q_h = torch.reshape(q, (b, t, self.h, self.d_k)).transpose(1, 2)
        k_h = torch.reshape(k, (b, t, self.h, self.d_k)).transpose(1, 2)
        v_h = torch.reshape(v, (b, t, self.h, self.d_k)).transpose(1, 2)
        return q_h, k_h, v_h, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, 1, time2)
            min_value = -float("inf")
            scores = scores.masked_fill(mask, min_value)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, x, mask):
        q_h, k_h, v_h, v = self.forward_qkv(x)
        fsmn_memory = self.forward_fsmn(v, mask)
        q_h = q_h * self.d_k ** (-0.5)
        scores = torch.matmul(q_h, k_h.transpose(-2, -1))
        att_outs = self.forward_attention(v_h, scores, mask)
        return att_outs + fsmn_memory


def sequence_mask(lengths, maxlen=None, dtype=torch.float32):
    if maxlen is None:
        maxlen = lengths.max()
    row_vector = torch.arange(0, maxlen, 1).to(lengths.device)
    matrix = torch.unsqueeze(lengths, dim=-1)
    mask = row_vector < matrix
    return mask.detach().type(dtype)


class EncoderLayerSANM(nn.Module):
    def __init__(self, in_size, size, self_attn, feed_forward):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(in_size)
        self.norm2 = nn.LayerNorm(size)
        self.in_size = in_size
        self.size = size

    def forward(self, x, mask):
        residual = x
        x = self.norm1(x)
        if self.in_size == self.size:
            x = residual + self.self_attn(x, mask)
        else:
            x = self.self_attn(x, mask)
        residual = x
        x = self.norm2(x)
        x = residual + self.feed_forward(x)
        return x, mask


class SenseVoiceEncoderSmall(nn.Module):
    def __init__(self, input_size, output_size=16, attention_heads=2, linear_units=32, num_blocks=3,
                 tp_blocks=1, kernel_size=5, sanm_shfit=0):
        super().__init__()
        self._output_size = output_size
        self.embed = SinusoidalPositionEncoder()
        mk = lambda i: MultiHeadedAttentionSANM(attention_heads, i, output_size, kernel_size, sanm_shfit)
        ff = lambda: PositionwiseFeedForward(output_size, linear_units)
        self.encoders0 = nn.ModuleList([EncoderLayerSANM(input_size, output_size, mk(input_size), ff())])
        self.encoders = nn.ModuleList(
            [EncoderLayerSANM(output_size, output_size, mk(output_size), ff()) for _ in range(num_blocks - 1)])
        self.tp_encoders = nn.ModuleList(
            [EncoderLayerSANM(output_size, output_size, mk(output_size), ff()) for _ in range(tp_blocks)])
        self.after_norm = nn.LayerNorm(output_size)
        self.tp_norm = nn.LayerNorm(output_size)

    def output_size(self):
        return self._output_size

    def forward(self, xs_pad, ilens):
        masks = sequence_mask(ilens)[:, None, :]
        xs_pad = xs_pad * self.output_size() ** 0.5
        xs_pad = self.embed(xs_pad)
        for encoder_layer in self.encoders0:
            xs_pad, masks = encoder_layer(xs_pad, masks)
        for encoder_layer in self.encoders:
            xs_pad, masks = encoder_layer(xs_pad, masks)
        xs_pad = self.after_norm(xs_pad)
        olens = masks.squeeze(1).sum(1).int()
        for encoder_layer in self.tp_encoders:
            xs_pad, masks = encoder_layer(xs_pad, masks)
        xs_pad = self.tp_norm(xs_pad)
        return xs_pad, olens


class SenseVoiceSmallTiny(nn.Module):
    def __init__(self, input_size=8, vocab_size=11):
        super().__init__()
        self.lid_dict = {"auto": 0, "zh": 3, "en": 4, "yue": 7, "ja": 11, "ko": 12, "nospeech": 13}
        self.textnorm_dict = {"withitn": 14, "woitn": 15}
        self.embed = nn.Embedding(7 + len(self.lid_dict) + len(self.textnorm_dict), input_size)
        self.encoder = SenseVoiceEncoderSmall(input_size)
        self.ctc_lo = nn.Linear(self.encoder.output_size(), vocab_size)
        self.blank_id = 0

    @torch.no_grad()
    def inference(self, speech, speech_lengths, language="en", textnorm="woitn"):
        speech_lengths = speech_lengths.clone()
        language_query = self.embed(torch.LongTensor([[self.lid_dict[language]]])).repeat(speech.size(0), 1, 1)
        textnorm_query = self.embed(torch.LongTensor([[self.textnorm_dict[textnorm]]])).repeat(speech.size(0), 1, 1)
        speech = torch.cat((textnorm_query, speech), dim=1)
        speech_lengths += 1
        event_emo_query = self.embed(torch.LongTensor([[1, 2]])).repeat(speech.size(0), 1, 1)
        input_query = torch.cat((language_query, event_emo_query), dim=1)
        speech = torch.cat((input_query, speech), dim=1)
        speech_lengths += 3
        encoder_out, encoder_out_lens = self.encoder(speech, speech_lengths)
        ctc_logits = F.log_softmax(self.ctc_lo(encoder_out), dim=-1)
        hyps = []
        for i in range(encoder_out.size(0)):
            x = ctc_logits[i, : encoder_out_lens[i].item(), :]
            yseq = torch.unique_consecutive(x.argmax(dim=-1), dim=-1)
            hyps.append(yseq[yseq != self.blank_id].tolist())
        return encoder_out, encoder_out_lens, ctc_logits, hyps


def main():
    model = SenseVoiceSmallTiny().eval()
    lengths = [13, 7, 10]
    feats = [torch.randn(n, 8) for n in lengths]
    T = max(lengths)
    speech = torch.zeros(len(lengths), T, 8)  # fbank batches are zero padded on the right
    for i, f in enumerate(feats):
        speech[i, : f.size(0)] = f
    speech_lengths = torch.tensor(lengths)

    out, olens, logits, hyps = model.inference(speech, speech_lengths)
    ok = torch.equal(olens, speech_lengths.int() + 4)
    for i, f in enumerate(feats):
        o1, l1, lg1, h1 = model.inference(f[None], torch.tensor([f.size(0)]))
        n = int(l1[0])
        ok &= n == int(olens[i])
        ok &= torch.allclose(out[i, :n], o1[0, :n], atol=1e-5)
        ok &= torch.allclose(logits[i, :n], lg1[0, :n], atol=1e-5)
        ok &= hyps[i] == h1[0]
    ok &= bool(torch.isfinite(out).all())
    print("padded batch matches each utterance alone:", bool(ok))
    assert ok


if __name__ == "__main__":
    main()
