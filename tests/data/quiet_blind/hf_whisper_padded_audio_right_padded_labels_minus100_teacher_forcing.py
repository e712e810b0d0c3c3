# transformers WhisperForConditionalGeneration.forward (models/whisper/modeling_whisper.py, shift_tokens_right) as used
# by the HF fine-tuning collator (DataCollatorSpeechSeq2SeqWithPadding): audio is zero-padded to the fixed window with
# no encoder mask; labels are right-padded with -100, which the decoder's causal mask keeps behind every real token.
import warnings; warnings.filterwarnings('ignore')
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration
torch.manual_seed(0)
cfg = WhisperConfig(vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                    max_source_positions=16, max_target_positions=32, pad_token_id=0, decoder_start_token_id=1,
                    bos_token_id=1, eos_token_id=2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
cfg._attn_implementation = "sdpa"
model = WhisperForConditionalGeneration(cfg).double().eval()
frames = [20, 32]  # real audio frames, rest of the 32-frame window is log-mel of silence (zeros)
transcripts = [[3, 4, 5, 6, 7, 8, 2], [9, 10, 2]]

with torch.no_grad():
    feats = torch.zeros(2, 8, 32, dtype=torch.float64)
    for i, f in enumerate(frames):
        feats[i, :, :f] = torch.randn(8, f, dtype=torch.float64)
    L = max(map(len, transcripts))
    labels = torch.full((2, L), -100)
    for i, t in enumerate(transcripts):
        labels[i, :len(t)] = torch.tensor(t)
    out = model(input_features=feats, labels=labels)  # decoder_input_ids = shift_tokens_right(labels, pad, start)
    logits = out.logits
    tok_loss, ref_tok, diff = 0.0, 0, 0.0
    for i, t in enumerate(transcripts):
        alone = model(input_features=feats[i:i + 1], labels=torch.tensor([t]))
        diff = max(diff, (logits[i, :len(t)] - alone.logits[0]).abs().max().item())
        tok_loss += alone.loss.item() * len(t); ref_tok += len(t)
    diff = max(diff, abs(out.loss.item() - tok_loss / ref_tok))
    print("max diff padded-label batch (logits on real tokens and -100 loss) vs each transcript alone:", diff)
    assert diff < 1e-10
