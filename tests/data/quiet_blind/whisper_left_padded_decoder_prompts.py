# Follows transformers models/whisper/modeling_whisper.py `prepare_inputs_for_generation`: LEFT-padded decoder
# prompts, decoder_position_ids = cumsum(decoder_attention_mask) - 1; 10 decoder queries cross-attend to 6 encoder
# frames with no mask. The padded batch (and one cached step) must equal each prompt alone.
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

torch.manual_seed(9)
cfg = WhisperConfig(vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                    max_source_positions=6, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, pad_token_id=59, bos_token_id=58, eos_token_id=57,
                    decoder_start_token_id=58)
model = WhisperForConditionalGeneration(cfg).double().eval()
model.set_attn_implementation("sdpa")  # float64; eager softmax runs in float32

feats = torch.randn(3, 8, 12, dtype=torch.float64)              # 12 frames -> 6 encoder positions
prompts = [torch.cat([torch.tensor([58]), torch.randint(0, 50, (n,))]) for n in (2, 9, 5)]
T = max(len(p) for p in prompts)
dec = torch.full((3, T), 59, dtype=torch.long)
dam = torch.zeros(3, T, dtype=torch.long)
for i, p in enumerate(prompts):
    dec[i, T - len(p):] = p
    dam[i, T - len(p):] = 1
pos = (dam.cumsum(-1) - 1).masked_fill(dam == 0, 0)

worst = 0.0
with torch.no_grad():
    out = model(input_features=feats, decoder_input_ids=dec, decoder_attention_mask=dam,
                decoder_position_ids=pos, use_cache=True)
    assert out.encoder_last_hidden_state.shape[1] < T           # more queries than cross-attention keys
    # one cached step continuing every row
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    dam2 = torch.cat([dam, torch.ones(3, 1, dtype=torch.long)], 1)
    step = model(encoder_outputs=(out.encoder_last_hidden_state,), decoder_input_ids=nxt,
                 decoder_attention_mask=dam2, decoder_position_ids=pos[:, -1:] + 1,
                 cache=out.past_key_values, use_cache=True)
    for i, p in enumerate(prompts):
        ref = model(input_features=feats[i:i + 1], decoder_input_ids=torch.cat([p, nxt[i]]).unsqueeze(0)).logits[0]
        d = max((out.logits[i, T - len(p):] - ref[:-1]).abs().max().item(),
                (step.logits[i, -1] - ref[-1]).abs().max().item())
        assert d == d, "NaN"
        worst = max(worst, d)
print(f"max |left-padded prompts (+1 cached step) - each alone| = {worst:.3e}")
assert worst < 1e-10
