"""XTTS GPT training forward (coqui-ai/TTS TTS/tts/layers/xtts/gpt.py), tiny, on transformers' GPT2Model.

Citation: coqui-ai/TTS#3216 (commit 73a5bd08, "Fix XTTS GPT padding and inference issues": "Fix end
artifact for fine tuning models").

Bug: GPT.forward shortened each row's code_lengths (ceil(wav_len / code_stride_len) + 3) by walking
back over trailing code 83 (the DVAE code of silence / of the zero-padded audio).  The shortened
length is the one attn_mask_mel, set_mel_padding and the -1 targets are built from, so a clip that
ends in real silence lost those frames: they were overwritten with the stop token, hidden from the
GPT's attention mask and dropped from the mel loss, and the model never learned to stop after them.
Fix: the trimming loop is removed; code_lengths keeps its + 3, set_mel_padding gets
code_lengths - 3, and attn_mask_mel / mel_targets keep using code_lengths.
"""
import functools
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GPT2Config, GPT2Model

FIXED = "--fixed" in sys.argv


def null_position_embeddings(range, dim):
    return torch.zeros((range.shape[0], range.shape[1], dim), device=range.device)


class LearnedPositionEmbeddings(nn.Module):
    def __init__(self, seq_len, model_dim, init=0.02):
        super().__init__()
        self.emb = torch.nn.Embedding(seq_len, model_dim)
        self.emb.weight.data.normal_(mean=0.0, std=init)

    def forward(self, x):
        sl = x.shape[1]
        return self.emb(torch.arange(0, sl, device=x.device))


def build_hf_gpt_transformer(layers, model_dim, heads, max_mel_seq_len, max_text_seq_len, max_prompt_len):
    gpt_config = GPT2Config(
        vocab_size=256,
        n_positions=max_mel_seq_len + max_text_seq_len + max_prompt_len,
        n_ctx=max_mel_seq_len + max_text_seq_len + max_prompt_len,
        n_embd=model_dim,
        n_layer=layers,
        n_head=heads,
        gradient_checkpointing=False,
        bos_token_id=None, eos_token_id=None,
        use_cache=False,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )
    gpt = GPT2Model(gpt_config)
    # Override the built in positional embeddings
    del gpt.wpe
    gpt.wpe = functools.partial(null_position_embeddings, dim=model_dim)
    # Built-in token embeddings are unused.
    del gpt.wte
    mel_pos_emb = LearnedPositionEmbeddings(max_mel_seq_len, model_dim)
    text_pos_emb = LearnedPositionEmbeddings(max_text_seq_len, model_dim)
    return gpt, mel_pos_emb, text_pos_emb


class ConditioningEncoder(nn.Module):
    def __init__(self, spec_dim, embedding_dim):
        super().__init__()
        self.init = nn.Conv1d(spec_dim, embedding_dim, kernel_size=1)

    def forward(self, x):
        return self.init(x)


class GPT(nn.Module):
    def __init__(self, start_text_token=29, stop_text_token=0, layers=2, model_dim=32, heads=4,
                 max_text_tokens=20, max_mel_tokens=30, max_prompt_tokens=10, max_conditioning_inputs=1,
                 code_stride_len=16, number_text_tokens=30, num_audio_tokens=100, start_audio_token=98,
                 stop_audio_token=99, label_smoothing=0.0):
        super().__init__()
        self.label_smoothing = label_smoothing
        self.number_text_tokens = number_text_tokens
        self.start_text_token = start_text_token
        self.stop_text_token = stop_text_token
        self.num_audio_tokens = num_audio_tokens
        self.start_audio_token = start_audio_token
        self.stop_audio_token = stop_audio_token
        self.max_conditioning_inputs = max_conditioning_inputs
        self.max_mel_tokens = max_mel_tokens + 2 + self.max_conditioning_inputs
        self.max_text_tokens = max_text_tokens + 2
        self.max_prompt_tokens = max_prompt_tokens
        self.code_stride_len = code_stride_len
        self.conditioning_encoder = ConditioningEncoder(80, model_dim)
        self.text_embedding = nn.Embedding(self.number_text_tokens, model_dim)
        self.mel_embedding = nn.Embedding(self.num_audio_tokens, model_dim)
        self.gpt, self.mel_pos_embedding, self.text_pos_embedding = build_hf_gpt_transformer(
            layers, model_dim, heads, self.max_mel_tokens, self.max_text_tokens, self.max_prompt_tokens)
        self.final_norm = nn.LayerNorm(model_dim)
        self.text_head = nn.Linear(model_dim, self.number_text_tokens)
        self.mel_head = nn.Linear(model_dim, self.num_audio_tokens)

    def set_inputs_and_targets(self, input, start_token, stop_token):
        inp = F.pad(input, (1, 0), value=start_token)
        tar = F.pad(input, (0, 1), value=stop_token)
        return inp, tar

    def set_mel_padding(self, mel_input_tokens, code_lengths):
        # Set padding areas within MEL (currently it is coded with the MEL code for <zero>).
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
        return self.conditioning_encoder(cond_input)  # (b, d, s)

    def forward(self, text_inputs, text_lengths, audio_codes, wav_lengths, cond_mels=None):
        max_text_len = text_lengths.max()
        code_lengths = torch.ceil(wav_lengths / self.code_stride_len).long() + 3

        # If len(codes) + 3 is larger than maxiumum allowed length, we truncate the codes.
        max_mel_len = code_lengths.max()

        if max_mel_len > audio_codes.shape[-1]:
            audio_codes = F.pad(audio_codes, (0, max_mel_len - audio_codes.shape[-1]))

        if not FIXED:
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

        # Append stop token to text inputs
        text_inputs = F.pad(text_inputs[:, :max_text_len], (0, 1), value=self.stop_text_token)

        # Append silence token to mel codes
        audio_codes = F.pad(audio_codes[:, :max_mel_len], (0, 1), value=self.stop_audio_token)

        # Pad mel codes with stop_audio_token
        if FIXED:
            # -3 to get the real code lengths without consider start and stop tokens that was not added yet
            audio_codes = self.set_mel_padding(audio_codes, code_lengths - 3)
        else:
            audio_codes = self.set_mel_padding(audio_codes, code_lengths)

        # Build input and target tensors
        text_inputs, text_targets = self.set_inputs_and_targets(text_inputs, self.start_text_token,
                                                                self.stop_text_token)
        audio_codes, mel_targets = self.set_inputs_and_targets(audio_codes, self.start_audio_token,
                                                               self.stop_audio_token)

        # Set attn_mask
        attn_mask_text = torch.ones(text_inputs.shape[0], text_inputs.shape[1], dtype=torch.bool,
                                    device=text_inputs.device)
        attn_mask_mel = torch.ones(audio_codes.shape[0], audio_codes.shape[1], dtype=torch.bool,
                                   device=audio_codes.device)
        for idx, l in enumerate(text_lengths):
            attn_mask_text[idx, l + 1:] = 0.0
        for idx, l in enumerate(code_lengths):
            attn_mask_mel[idx, l + 1:] = 0.0

        text_emb = self.text_embedding(text_inputs) + self.text_pos_embedding(text_inputs)
        mel_emb = self.mel_embedding(audio_codes) + self.mel_pos_embedding(audio_codes)
        cond_latents = self.get_style_emb(cond_mels).transpose(1, 2)

        text_logits, mel_logits = self.get_logits(
            text_emb, self.text_head, mel_emb, self.mel_head, prompt=cond_latents,
            attn_mask_text=attn_mask_text, attn_mask_mel=attn_mask_mel,
        )

        # Set paddings to -1 to ignore them in loss
        for idx, l in enumerate(text_lengths):
            text_targets[idx, l + 1:] = -1
        for idx, l in enumerate(code_lengths):
            mel_targets[idx, l + 1:] = -1

        assert (mel_targets == self.stop_audio_token).sum() >= mel_targets.shape[0]

        loss_text = F.cross_entropy(text_logits, text_targets.long(), ignore_index=-1,
                                    label_smoothing=self.label_smoothing)
        loss_mel = F.cross_entropy(mel_logits, mel_targets.long(), ignore_index=-1,
                                   label_smoothing=self.label_smoothing)
        return loss_text.mean(), loss_mel.mean(), mel_logits


def main():
    torch.manual_seed(0)
    model = GPT().eval()
    B = 2
    # XTTS dataset batch: wavs right-padded with zeros, DVAE codes taken from the padded batch,
    # so frames past a clip's end come out as 83 (the code of zero audio).
    wav_lengths = torch.tensor([160, 112])  # code_stride_len 16 -> 10 and 7 frames
    text_lengths = torch.tensor([8, 5])
    text_inputs = torch.randint(1, 29, (B, 8))
    text_inputs[1, 5:] = 0
    audio_codes = torch.randint(0, 83, (B, 10))
    audio_codes[1, 7:] = 83   # zero padding of the shorter clip
    audio_codes[1, 4:7] = 83  # the shorter clip ends with real silence
    cond_mels = torch.randn(B, 1, 80, 6)

    with torch.no_grad():
        loss_text, loss_mel, mel_logits = model(text_inputs, text_lengths, audio_codes.clone(), wav_lengths,
                                                cond_mels=cond_mels)
    print(f"loss_text {loss_text.item():.6f}  loss_mel {loss_mel.item():.6f}")
    print("row 1 mel logits argmax:", mel_logits[1].argmax(0).tolist())


if __name__ == "__main__":
    main()
