# Correct program (quiet batch quiet-r66a).
# Citation: huggingface/transformers src/transformers/models/qwen2_audio/modeling_qwen2_audio.py
#   (Qwen2AudioModel.forward: audio_feat_lengths from feature_attention_mask.sum(-1) via
#   Qwen2AudioEncoder._get_feat_extract_output_lengths, seq_range >= lengths_expand -> padding_mask ->
#   create_bidirectional_mask -> audio_tower(input_features, attention_mask=...); audio features cut to
#   audio_output_lengths and scattered into the <|AUDIO|> slots), as installed (transformers 5.25.0); the same mask
#   construction (a float mask with -inf on padded frames) at commit 01ae98ae2414210efd0d9ac1ffe78ff21588f1f7;
#   processing_qwen2_audio.py (padding="max_length" on the mel frames, num_audio_tokens =
#   (((l - 1) // 2 + 1) - 2) // 2 + 1 placeholders per clip).
# Two clips of different lengths: their log-mel frames are padded to the encoder's fixed window (the Whisper
# feature extractor pads to max_length, here 32 frames) and feature_attention_mask marks the real ones. The model
# turns those lengths into a key padding mask over the conv-downsampled frames, runs the audio tower, keeps only
# the pooled frames that come from real audio and writes them into the prompt's audio placeholders. The prompts
# are left-padded for batched generation (Qwen2-Audio's padding side is left). The check: logits at every real
# token position and the greedy continuation equal each prompt run alone (unpadded text), and the audio tower's
# real frames equal its layers run on the real frames alone with no mask.
import torch
from transformers import Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration, Qwen2Config

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS, PAD = 5, 6, 7, 0
audio_config = Qwen2AudioEncoderConfig(num_mel_bins=8, encoder_layers=2, encoder_attention_heads=4,
                                       encoder_ffn_dim=64, d_model=32, max_source_positions=16)
text_config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          pad_token_id=PAD, eos_token_id=63, bos_token_id=1)
config = Qwen2AudioConfig(audio_config=audio_config, text_config=text_config, audio_token_index=AUDIO_TOKEN)
model = Qwen2AudioForConditionalGeneration(config).eval()
N_FRAMES = audio_config.max_source_positions * 2          # the feature extractor's max_length (3000 upstream)

# --- the processor's work, written out -------------------------------------------------------------------------
mel_lengths = [29, 13]
mels = [torch.randn(audio_config.num_mel_bins, n) for n in mel_lengths]
input_features = torch.full((2, audio_config.num_mel_bins, N_FRAMES), -0.75)   # log-mel of the zero-padded tail
feature_attention_mask = torch.zeros(2, N_FRAMES, dtype=torch.long)
for i, m in enumerate(mels):
    input_features[i, :, : m.shape[1]] = m
    feature_attention_mask[i, : m.shape[1]] = 1
num_audio_tokens = [(((l - 1) // 2 + 1) - 2) // 2 + 1 for l in feature_attention_mask.sum(-1).tolist()]

texts_before = [[1, 11, 12], [1, 13]]
texts_after = [[21, 22, 23, 24], [25, 26]]
prompts = [texts_before[i] + [AUDIO_BOS] + [AUDIO_TOKEN] * num_audio_tokens[i] + [AUDIO_EOS] + texts_after[i]
           for i in range(2)]
width = max(len(p) for p in prompts)
input_ids = torch.full((2, width), PAD, dtype=torch.long)
attention_mask = torch.zeros(2, width, dtype=torch.long)
for i, p in enumerate(prompts):                          # left padding, as for batched generation
    input_ids[i, width - len(p):] = torch.tensor(p)
    attention_mask[i, width - len(p):] = 1

position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)   # as generate() builds them

with torch.no_grad():
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                input_features=input_features, feature_attention_mask=feature_attention_mask)
    gen = model.generate(input_ids=input_ids, attention_mask=attention_mask, input_features=input_features,
                         feature_attention_mask=feature_attention_mask, max_new_tokens=4, do_sample=False,
                         pad_token_id=PAD)

# --- reference 1: each prompt alone, no text padding -------------------------------------------------------------
worst = 0.0
with torch.no_grad():
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        one = model(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=input_features[i:i + 1],
                    feature_attention_mask=feature_attention_mask[i:i + 1])
        real = attention_mask[i].bool()
        worst = max(worst, (out.logits[i, real] - one.logits[0]).abs().max().item())
        gen_one = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 input_features=input_features[i:i + 1],
                                 feature_attention_mask=feature_attention_mask[i:i + 1], max_new_tokens=4,
                                 do_sample=False, pad_token_id=PAD)
        assert gen[i, width:].tolist() == gen_one[0, len(p):].tolist(), (gen[i, width:], gen_one[0, len(p):])

# --- reference 2: the audio tower's layers over the real frames only, no mask -------------------------------------
tower = model.model.audio_tower if hasattr(model, "model") else model.audio_tower
feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(feature_attention_mask.sum(-1))
with torch.no_grad():
    max_seq_len = (N_FRAMES - 2) // 2 + 1
    seq_range = torch.arange(max_seq_len)[None, :].expand(2, max_seq_len)
    padding_mask = seq_range >= feat_lengths[:, None].expand(2, max_seq_len)
    bias = torch.zeros(2, 1, max_seq_len, max_seq_len).masked_fill(padding_mask[:, None, None, :], float("-inf"))
    batched = tower(input_features, attention_mask=bias).last_hidden_state
    for i in range(2):
        h = torch.nn.functional.gelu(tower.conv1(input_features[i:i + 1]))
        h = torch.nn.functional.gelu(tower.conv2(h)).permute(0, 2, 1) + tower.embed_positions.weight
        h = h[:, : feat_lengths[i]]                       # real frames only
        for layer in tower.layers:
            h = layer(h, None)
            h = h[0] if isinstance(h, tuple) else h
        h = tower.layer_norm(tower.avg_pooler(h.permute(0, 2, 1)).permute(0, 2, 1))
        n = int(out_lengths[i])
        assert n == num_audio_tokens[i]
        worst = max(worst, (batched[i, :n] - h[0, :n]).abs().max().item())

print("audio tokens per clip", num_audio_tokens, "generated", gen[:, width:].tolist(), "max diff %.2e" % worst)
assert worst < 1e-10, worst
