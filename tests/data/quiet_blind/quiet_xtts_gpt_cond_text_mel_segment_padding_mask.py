"""XTTS GPT training forward (coqui-ai/TTS), tiny, on transformers' GPT2Model built from GPT2Config.

Citation: coqui-ai/TTS @01839af926ea1bd528e4e6489ca68105a5e8bfb8 TTS/tts/layers/xtts/gpt.py
  (build_hf_gpt_transformer with null_position_embeddings in place of GPT-2's wpe,
   LearnedPositionEmbeddings, GPT.set_inputs_and_targets, GPT.set_mel_padding, GPT.get_logits,
   GPT.forward: attn_mask_cond / attn_mask_text / attn_mask_mel, targets -1 past the lengths);
  TTS/tts/layers/xtts/latent_encoder.py (ConditioningEncoder: Conv1d + unmasked AttentionBlocks over
   the fixed-length conditioning mel crop).

The GPT reads one row of [conditioning latents | text segment | mel segment].  The text segment and
the mel segment are each right-padded to the batch maximum, so a shorter row carries padding in the
middle (after its text) and at the end (after its codes).  forward builds one bool mask per
segment (text valid up to l + 1: start token and l tokens; mel valid up to code_length + 1) and
get_logits concatenates [cond ones | text | mel] into the 2-D attention_mask that GPT-2 combines with
its causal mask.  Positions are per segment (LearnedPositionEmbeddings over arange(segment length));
GPT-2's own position embedding is nulled, so the padding in the middle shifts nothing.

Check: for every sample, the text and mel logits at its real positions and the two losses equal an
independent per-query-loop GPT-2 over that sample alone with its padding removed and no mask (run
for attn_implementation "eager" and "sdpa").
"""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GPT2Config, GPT2Model

torch.manual_seed(0)


def null_position_embeddings(range, dim):
    return torch.zeros((range.shape[0], range.shape[1], dim), device=range.device)


class LearnedPositionEmbeddings(nn.Module):
    def __init__(self, seq_len, model_dim, init=0.02):
        super().__init__()
        self.emb = torch.nn.Embedding(seq_len, model_dim)
        self.emb.weight.data.normal_(mean=0.0, std=init)
        self.seq_len = seq_len

    def forward(self, x):
        sl = x.shape[1]
        return self.emb(torch.arange(0, sl, device=x.device))


class AttentionBlock(nn.Module):
    """tortoise / XTTS AttentionBlock (GroupNorm, qkv conv1d, legacy QKV attention), mask=None."""

    def __init__(self, channels, num_heads):
        super().__init__()
        self.channels = channels
        self.num_heads = num_heads
        self.norm = nn.GroupNorm(8, channels)
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.proj_out = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        b, c, t = x.shape
        qkv = self.qkv(self.norm(x))
        bs, width, length = qkv.shape
        ch = width // (3 * self.num_heads)
        q, k, v = qkv.reshape(bs * self.num_heads, ch * 3, length).split(ch, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale)
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        a = torch.einsum("bts,bcs->bct", weight, v).reshape(bs, -1, length)
        return x + self.proj_out(a)


class ConditioningEncoder(nn.Module):
    def __init__(self, spec_dim, embedding_dim, attn_blocks=2, num_attn_heads=4):
        super().__init__()
        self.init = nn.Conv1d(spec_dim, embedding_dim, kernel_size=1)
        self.attn = nn.Sequential(*[AttentionBlock(embedding_dim, num_attn_heads) for _ in range(attn_blocks)])

    def forward(self, x):
        return self.attn(self.init(x))


def build_hf_gpt_transformer(layers, model_dim, heads, max_mel_seq_len, max_text_seq_len, max_prompt_len,
                             attn_implementation):
    gpt_config = GPT2Config(
        vocab_size=256,
        n_positions=max_mel_seq_len + max_text_seq_len + max_prompt_len,
        n_ctx=max_mel_seq_len + max_text_seq_len + max_prompt_len,
        n_embd=model_dim,
        n_layer=layers,
        n_head=heads,
        use_cache=False,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )
    gpt_config._attn_implementation = attn_implementation
    gpt = GPT2Model(gpt_config)
    del gpt.wpe
    gpt.wpe = functools.partial(null_position_embeddings, dim=model_dim)
    del gpt.wte
    mel_pos_emb = LearnedPositionEmbeddings(max_mel_seq_len, model_dim)
    text_pos_emb = LearnedPositionEmbeddings(max_text_seq_len, model_dim)
    return gpt, mel_pos_emb, text_pos_emb


class GPT(nn.Module):
    def __init__(self, start_text_token=29, stop_text_token=0, layers=2, model_dim=32, heads=4,
                 max_text_tokens=20, max_mel_tokens=30, max_prompt_tokens=10, max_conditioning_inputs=1,
                 code_stride_len=16, number_text_tokens=30, num_audio_tokens=100, start_audio_token=98,
                 stop_audio_token=99, label_smoothing=0.0, attn_implementation="eager"):
        super().__init__()
        self.label_smoothing = label_smoothing
        self.number_text_tokens = number_text_tokens
        self.start_text_token = start_text_token
        self.stop_text_token = stop_text_token
        self.num_audio_tokens = num_audio_tokens
        self.start_audio_token = start_audio_token
        self.stop_audio_token = stop_audio_token
        self.layers = layers
        self.heads = heads
        self.model_dim = model_dim
        self.max_conditioning_inputs = max_conditioning_inputs
        self.max_mel_tokens = max_mel_tokens + 2 + self.max_conditioning_inputs
        self.max_text_tokens = max_text_tokens + 2
        self.max_prompt_tokens = max_prompt_tokens
        self.code_stride_len = code_stride_len
        self.conditioning_encoder = ConditioningEncoder(80, model_dim, num_attn_heads=heads)
        self.text_embedding = nn.Embedding(self.number_text_tokens, model_dim)
        self.mel_embedding = nn.Embedding(self.num_audio_tokens, model_dim)
        self.gpt, self.mel_pos_embedding, self.text_pos_embedding = build_hf_gpt_transformer(
            layers, model_dim, heads, self.max_mel_tokens, self.max_text_tokens, self.max_prompt_tokens,
            attn_implementation,
        )
        self.final_norm = nn.LayerNorm(model_dim)
        self.text_head = nn.Linear(model_dim, self.number_text_tokens)
        self.mel_head = nn.Linear(model_dim, self.num_audio_tokens)

    def set_inputs_and_targets(self, input, start_token, stop_token):
        inp = F.pad(input, (1, 0), value=start_token)
        tar = F.pad(input, (0, 1), value=stop_token)
        return inp, tar

    def set_mel_padding(self, mel_input_tokens, code_lengths):
        for b in range(len(code_lengths)):
            actual_end = code_lengths[b]
            if actual_end < mel_input_tokens.shape[-1]:
                mel_input_tokens[b, actual_end:] = self.stop_audio_token
        return mel_input_tokens

    def get_logits(self, first_inputs, first_head, second_inputs=None, second_head=None, prompt=None,
                   attn_mask_cond=None, attn_mask_text=None, attn_mask_mel=None):
        if prompt is not None:
            offset = prompt.shape[1]
            if second_inputs is not None:
                emb = torch.cat([prompt, first_inputs, second_inputs], dim=1)
            else:
                emb = torch.cat([prompt, first_inputs], dim=1)

        attn_mask = None
        if attn_mask_text is not None:
            attn_mask = torch.cat([attn_mask_text, attn_mask_mel], dim=1)
            if prompt is not None:
                if attn_mask_cond is not None:
                    attn_mask = torch.cat([attn_mask_cond, attn_mask], dim=1)
                else:
                    attn_mask_cond = torch.ones(prompt.shape[0], offset, dtype=torch.bool, device=emb.device)
                    attn_mask = torch.cat([attn_mask_cond, attn_mask], dim=1)

        gpt_out = self.gpt(inputs_embeds=emb, return_dict=True, attention_mask=attn_mask)
        enc = gpt_out.last_hidden_state[:, offset:]
        enc = self.final_norm(enc)
        first_logits = first_head(enc[:, : first_inputs.shape[1]]).permute(0, 2, 1)
        second_logits = second_head(enc[:, -second_inputs.shape[1]:]).permute(0, 2, 1)
        return first_logits, second_logits

    def get_style_emb(self, cond_input):
        if cond_input.ndim == 4:
            cond_input = cond_input.squeeze(1)
        return self.conditioning_encoder(cond_input)

    def forward(self, text_inputs, text_lengths, audio_codes, wav_lengths, cond_mels=None, cond_idxs=None):
        max_text_len = text_lengths.max()
        code_lengths = torch.ceil(wav_lengths / self.code_stride_len).long() + 3
        max_mel_len = code_lengths.max()
        if max_mel_len > audio_codes.shape[-1]:
            audio_codes = F.pad(audio_codes, (0, max_mel_len - audio_codes.shape[-1]))

        silence = True
        for idx, l in enumerate(code_lengths):
            length = l.item()
            while silence:
                if audio_codes[idx, length - 1] != 83:
                    break
                length -= 1
            code_lengths[idx] = length

        assert max_mel_len <= audio_codes.shape[-1]
        assert max_text_len <= text_inputs.shape[-1]

        text_inputs = F.pad(text_inputs[:, :max_text_len], (0, 1), value=self.stop_text_token)
        audio_codes = F.pad(audio_codes[:, :max_mel_len], (0, 1), value=self.stop_audio_token)
        audio_codes = self.set_mel_padding(audio_codes, code_lengths)

        text_inputs, text_targets = self.set_inputs_and_targets(text_inputs, self.start_text_token,
                                                                self.stop_text_token)
        audio_codes, mel_targets = self.set_inputs_and_targets(audio_codes, self.start_audio_token,
                                                               self.stop_audio_token)

        # Set attn_mask
        attn_mask_cond = torch.ones(cond_mels.shape[0], cond_mels.shape[-1], dtype=torch.bool,
                                    device=text_inputs.device)
        attn_mask_text = torch.ones(text_inputs.shape[0], text_inputs.shape[1], dtype=torch.bool,
                                    device=text_inputs.device)
        attn_mask_mel = torch.ones(audio_codes.shape[0], audio_codes.shape[1], dtype=torch.bool,
                                   device=audio_codes.device)
        if cond_idxs is not None:
            for idx, r in enumerate(cond_idxs):
                l = r[1] - r[0]
                attn_mask_cond[idx, l:] = 0.0
        for idx, l in enumerate(text_lengths):
            attn_mask_text[idx, l + 1:] = 0.0
        for idx, l in enumerate(code_lengths):
            attn_mask_mel[idx, l + 1:] = 0.0

        text_emb = self.text_embedding(text_inputs) + self.text_pos_embedding(text_inputs)
        mel_emb = self.mel_embedding(audio_codes) + self.mel_pos_embedding(audio_codes)
        cond_latents = self.get_style_emb(cond_mels).transpose(1, 2)

        text_logits, mel_logits = self.get_logits(
            text_emb, self.text_head, mel_emb, self.mel_head, prompt=cond_latents,
            attn_mask_cond=attn_mask_cond, attn_mask_text=attn_mask_text, attn_mask_mel=attn_mask_mel,
        )

        for idx, l in enumerate(text_lengths):
            text_targets[idx, l + 1:] = -1
        for idx, l in enumerate(code_lengths):
            mel_targets[idx, l + 1:] = -1
        assert (mel_targets == self.stop_audio_token).sum() >= mel_targets.shape[0]

        loss_text = F.cross_entropy(text_logits, text_targets.long(), ignore_index=-1,
                                    label_smoothing=self.label_smoothing)
        loss_mel = F.cross_entropy(mel_logits, mel_targets.long(), ignore_index=-1,
                                   label_smoothing=self.label_smoothing)
        return loss_text.mean(), loss_mel.mean(), text_logits, mel_logits, code_lengths


# ------------------------------------------------------------------ independent reference
def ref_gpt2(gpt, x):
    """Per-query loop causal GPT-2 on one unpadded sequence x: (T, D)."""
    T, D = x.shape
    for blk in gpt.h:
        h = blk.ln_1(x)
        qkv = h @ blk.attn.c_attn.weight + blk.attn.c_attn.bias
        q, k, v = qkv.split(D, dim=-1)
        H = gpt.config.n_head
        hs = D // H
        out = torch.zeros(T, D)
        for hd in range(H):
            sl = slice(hd * hs, (hd + 1) * hs)
            for i in range(T):
                s = (k[: i + 1, sl] @ q[i, sl]) / math.sqrt(hs)
                out[i, sl] = torch.softmax(s, 0) @ v[: i + 1, sl]
        x = x + (out @ blk.attn.c_proj.weight + blk.attn.c_proj.bias)
        x = x + blk.mlp(blk.ln_2(x))
    return gpt.ln_f(x)


def reference_one(m, text, audio, cond_mel):
    l, L = text.shape[0], audio.shape[0]
    t_in = torch.cat([torch.tensor([m.start_text_token]), text])                # start + l tokens
    t_tar = torch.cat([text, torch.tensor([m.stop_text_token])])
    a_in = torch.cat([torch.tensor([m.start_audio_token]), audio])
    a_tar = torch.cat([audio, torch.tensor([m.stop_audio_token])])
    t_emb = m.text_embedding(t_in) + m.text_pos_embedding.emb.weight[: l + 1]
    a_emb = m.mel_embedding(a_in) + m.mel_pos_embedding.emb.weight[: L + 1]
    cond = m.conditioning_encoder(cond_mel[None])[0].T
    S = cond.shape[0]
    h = ref_gpt2(m.gpt, torch.cat([cond, t_emb, a_emb], 0))[S:]
    h = m.final_norm(h)
    return m.text_head(h[: l + 1]), m.mel_head(h[l + 1:]), t_tar, a_tar


def main():
    torch.manual_seed(0)
    base = GPT(attn_implementation="eager").eval()
    B, S = 3, 6
    text_lengths = torch.tensor([5, 9, 3])
    wav_lengths = torch.tensor([100, 60, 140])          # code_stride_len 16 -> 7+3, 4+3, 9+3 codes
    text_inputs = torch.randint(1, 29, (B, 11))
    for b in range(B):
        text_inputs[b, text_lengths[b]:] = 0             # collater pads with 0 (= stop_text_token)
    audio_codes = torch.randint(0, 83, (B, 14))
    audio_codes[1, 5:7] = 83                             # trailing silence codes of sample 1 are trimmed
    cond_mels = torch.randn(B, 1, 80, S)

    # independent lengths of each sample's real codes
    real_L = []
    for b in range(B):
        L = int(math.ceil(wav_lengths[b].item() / 16)) + 3
        while audio_codes[b, L - 1] == 83:
            L -= 1
        real_L.append(L)

    ok = True
    for impl in ("eager", "sdpa"):
        model = GPT(attn_implementation=impl).eval()
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            loss_text, loss_mel, text_logits, mel_logits, code_lengths = model(
                text_inputs.clone(), text_lengths, audio_codes.clone(), wav_lengths, cond_mels=cond_mels
            )
            assert code_lengths.tolist() == real_L, (code_lengths, real_L)
            all_t, all_tt, all_m, all_mt = [], [], [], []
            for b in range(B):
                l, L = int(text_lengths[b]), real_L[b]
                r_t, r_m, t_tar, a_tar = reference_one(model, text_inputs[b, :l], audio_codes[b, :L],
                                                       cond_mels[b, 0])
                t_ok = torch.allclose(text_logits[b, :, : l + 1].T, r_t, atol=1e-4, rtol=1e-4)
                m_ok = torch.allclose(mel_logits[b, :, : L + 1].T, r_m, atol=1e-4, rtol=1e-4)
                print(f"[{impl}] sample {b} (text {l}, codes {L}): text logits "
                      f"{'match' if t_ok else 'MISMATCH'}, mel logits {'match' if m_ok else 'MISMATCH'}")
                ok &= t_ok and m_ok
                all_t.append(r_t); all_tt.append(t_tar); all_m.append(r_m); all_mt.append(a_tar)
            ref_lt = F.cross_entropy(torch.cat(all_t), torch.cat(all_tt))
            ref_lm = F.cross_entropy(torch.cat(all_m), torch.cat(all_mt))
            l_ok = torch.allclose(loss_text, ref_lt, atol=1e-5) and torch.allclose(loss_mel, ref_lm, atol=1e-5)
            print(f"[{impl}] loss_text {loss_text.item():.5f}/{ref_lt.item():.5f}, "
                  f"loss_mel {loss_mel.item():.5f}/{ref_lm.item():.5f}: {'match' if l_ok else 'MISMATCH'}")
            ok &= l_ok
    print("ALL MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
