"""SALMONN speech LLM: unmasked Whisper encoder, window-level Q-Former, LLaMA over [bos, prompt, speech, text].

Follows bytedance/SALMONN models/salmonn.py (encode_speech with window_level_Qformer: F.unfold into windows of
kernel = round(1500 * second_per_window / 30) frames, speech_atts all ones; prompt_wrap around <SpeechHere>;
forward: targets = text ids with pad -> -100, empty_targets for bos + prompt + speech, attention_mask =
cat([atts_bos, speech_atts, to_regress_tokens.attention_mask])).  The Whisper encoder has no attention mask on
purpose: every clip is padded with silence to the fixed 30 s window the model was trained on, and the encoder
attends over all of it.  Each Q-Former window's 1 query cross-attends its kernel frames with no mask (no frame
is padding).  The LLaMA decoder is causal with right padding of the text.  Checked: each sample alone, with
unpadded text, gives the same logits on its real tokens and the same loss.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

N_MELS, N_AUDIO_FRAMES, D_AUDIO, D_LLM, VOCAB, PAD, BOS, EOS = 16, 120, 32, 48, 60, 0, 1, 2


class WhisperEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(N_MELS, D_AUDIO, 3, padding=1)
        self.conv2 = nn.Conv1d(D_AUDIO, D_AUDIO, 3, stride=2, padding=1)
        self.embed_positions = nn.Parameter(torch.randn(N_AUDIO_FRAMES // 2, D_AUDIO) * 0.02)
        layer = nn.TransformerEncoderLayer(D_AUDIO, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.layer_norm = nn.LayerNorm(D_AUDIO)

    def forward(self, input_features):
        x = F.gelu(self.conv2(F.gelu(self.conv1(input_features)))).transpose(1, 2)
        return self.layer_norm(self.layers(x + self.embed_positions))  # no mask: 30 s window incl. silence


class LlamaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D_LLM)
        self.pos = nn.Embedding(64, D_LLM)
        self.qkv = nn.ModuleList(nn.Linear(D_LLM, 3 * D_LLM, bias=False) for _ in range(2))
        self.o = nn.ModuleList(nn.Linear(D_LLM, D_LLM, bias=False) for _ in range(2))
        self.norm = nn.RMSNorm(D_LLM)
        self.lm_head = nn.Linear(D_LLM, VOCAB, bias=False)

    def forward(self, inputs_embeds, attention_mask, labels=None):
        b, t, _ = inputs_embeds.shape
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        h = inputs_embeds + self.pos(position_ids)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(h).view(b, t, 3, 4, D_LLM // 4).permute(2, 0, 3, 1, 4)
            h = h + o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, -1))
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
        return logits, loss


class SALMONN(nn.Module):
    def __init__(self, second_per_window=3.0, second_stride=3.0, num_speech_query_token=1):
        super().__init__()
        self.speech_encoder = WhisperEncoder()
        self.ln_speech = nn.LayerNorm(D_AUDIO)
        self.speech_query_tokens = nn.Parameter(torch.randn(1, num_speech_query_token, D_AUDIO) * 0.02)
        qlayer = nn.TransformerDecoderLayer(D_AUDIO, 4, 64, dropout=0.0, batch_first=True)
        self.speech_Qformer = nn.TransformerDecoder(qlayer, 2)
        self.speech_llama_proj = nn.Linear(D_AUDIO, D_LLM)
        self.llama_model = LlamaModel()
        self.second_per_window, self.second_stride = second_per_window, second_stride

    def encode_speech(self, spectrogram):
        speech_embeds = self.ln_speech(self.speech_encoder(spectrogram))
        B, T, C = speech_embeds.shape
        kernel = (1, round(T * self.second_per_window / 30.0))
        stride = (1, round(T * self.second_stride / 30.0))
        speech_embeds_tr = speech_embeds.transpose(1, 2).unsqueeze(2)
        overlap = F.unfold(speech_embeds_tr, kernel_size=kernel, dilation=1, padding=0, stride=stride)
        _, _, L = overlap.shape
        overlap = overlap.view(B, -1, kernel[1], L).permute(0, 3, 2, 1)
        speech_embeds = overlap.reshape(-1, kernel[1], C)
        query_tokens = self.speech_query_tokens.expand(speech_embeds.shape[0], -1, -1)
        # every frame of a window is a real frame: the Q-Former's encoder_attention_mask is all ones
        query_output = self.speech_Qformer(query_tokens, speech_embeds)
        speech_embeds = self.speech_llama_proj(query_output).view(B, -1, D_LLM)
        return speech_embeds, torch.ones(speech_embeds.shape[:-1], dtype=torch.long)

    def prompt_wrap(self, embeds, atts, p_before, p_after):
        emb = self.llama_model.embed_tokens
        b = embeds.size(0)
        wrapped = torch.cat([emb(p_before).expand(b, -1, -1), embeds, emb(p_after).expand(b, -1, -1)], 1)
        return wrapped, torch.ones(wrapped.shape[:-1], dtype=torch.long)

    def forward(self, spectrogram, text_ids, p_before, p_after):
        speech_embeds, speech_atts = self.encode_speech(spectrogram)
        speech_embeds, speech_atts = self.prompt_wrap(speech_embeds, speech_atts, p_before, p_after)
        width = max(len(t) for t in text_ids)
        input_ids = torch.stack([F.pad(t, (0, width - len(t)), value=PAD) for t in text_ids])  # padding_side right
        text_mask = (torch.arange(width)[None] < torch.tensor([len(t) for t in text_ids])[:, None]).long()
        targets = input_ids.masked_fill(text_mask == 0, -100)
        B = input_ids.size(0)
        empty_targets = torch.full((B, speech_atts.size(1) + 1), -100, dtype=torch.long)
        targets = torch.cat([empty_targets, targets], dim=1)
        bos_embeds = self.llama_model.embed_tokens(torch.full((B, 1), BOS))
        inputs_embeds = torch.cat([bos_embeds, speech_embeds, self.llama_model.embed_tokens(input_ids)], dim=1)
        attention_mask = torch.cat([torch.ones(B, 1, dtype=torch.long), speech_atts, text_mask], dim=1)
        logits, loss = self.llama_model(inputs_embeds, attention_mask, labels=targets)
        return logits, loss, attention_mask


def main():
    torch.manual_seed(0)
    model = SALMONN().eval()
    spectrogram = torch.randn(3, N_MELS, N_AUDIO_FRAMES)
    spectrogram[0, :, 70:] = -1.0  # a short clip: log-mel of the silence it was padded with
    p_before, p_after = torch.tensor([5, 6]), torch.tensor([7, 8, 9])  # "<Speech>" / "</Speech> Transcribe:"
    texts = [torch.cat([torch.randint(10, VOCAB, (n,)), torch.tensor([EOS])]) for n in (4, 7, 2)]
    with torch.no_grad():
        logits, loss, attention_mask = model(spectrogram, texts, p_before, p_after)
        total, count = 0.0, 0
        for i, t in enumerate(texts):
            lg, ls, am = model(spectrogram[i:i + 1], [t], p_before, p_after)
            real = attention_mask[i].bool()
            torch.testing.assert_close(logits[i][real], lg[0], rtol=1e-4, atol=1e-4)
            total, count = total + ls.item() * len(t), count + len(t)
        torch.testing.assert_close(loss.item(), total / count, rtol=1e-4, atol=1e-5)
    print("llm input", tuple(logits.shape), "loss", round(loss.item(), 4))


if __name__ == "__main__":
    main()
