"""Short-form batched Whisper transcription with a text prompt, as transformers documents it: the
feature extractor pads audios of different lengths with zeros to the model's fixed window and
returns a frame-level attention_mask; WhisperForConditionalGeneration.generate reads the padded
log-mel window whole (the encoder takes no mask: Whisper is trained on zero-padded 30 s windows),
puts the shared `prompt_ids` ([<|startofprev|>, prompt tokens]) in front of the init tokens
([<|startoftranscript|>, <|notimestamps|>]) of every row, and decodes greedily with an
EncoderDecoderCache: causal self-attention over the prompt + generated tokens, cross-attention over
every encoder frame. Every row has the same prompt, so no decoder padding and no
decoder_attention_mask (generate pops it).

Follows huggingface/transformers @79f1fc71ad1e0220e2b05723f5fd2e14bc270de5:
  src/transformers/models/whisper/generation_whisper.py   WhisperGenerationMixin.generate
        (short-form path), _retrieve_init_tokens, _prepare_decoder_input_ids (`elif prompt_ids is
        not None` branch), _retrieve_max_frames_and_seek
  src/transformers/models/whisper/feature_extraction_whisper.py   WhisperFeatureExtractor.__call__
        (padding="max_length", return_attention_mask=True)
  src/transformers/models/whisper/processing_whisper.py / tokenization_whisper.py get_prompt_ids
        ([<|startofprev|>] + " " + text tokens), written out with token ids here
and runs the installed transformers 5 classes. Tiny WhisperConfig (random weights), a 1 s window
(chunk_length=1, 100 mel frames, max_source_positions=50), float64; no downloads.

Check: each row's generated tokens and per-step scores equal that audio transcribed alone by a
greedy loop without a cache (the whole decoder sequence re-run through the model every step).
"""
import numpy as np
import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

torch.manual_seed(1)

# token ids of a tiny vocabulary, laid out like Whisper's special tokens at the top of the vocab
VOCAB = 96
EOT = 90  # <|endoftext|>, also pad
SOT = 91  # <|startoftranscript|>
PREV = 92  # <|startofprev|>
NO_TIMESTAMPS = 93  # <|notimestamps|>
SAMPLING_RATE = 16000

config = WhisperConfig(
    vocab_size=VOCAB,
    num_mel_bins=8,
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=4,
    decoder_layers=2,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_source_positions=50,
    max_target_positions=40,
    pad_token_id=EOT,
    bos_token_id=EOT,
    eos_token_id=EOT,
    decoder_start_token_id=SOT,
    suppress_tokens=None,
    begin_suppress_tokens=None,
    init_std=0.3,
    attn_implementation="sdpa",
)
model = WhisperForConditionalGeneration(config).to(torch.float64).eval()

model.generation_config = GenerationConfig(
    decoder_start_token_id=SOT,
    pad_token_id=EOT,
    bos_token_id=EOT,
    eos_token_id=EOT,
    no_timestamps_token_id=NO_TIMESTAMPS,
    prev_sot_token_id=PREV,
    is_multilingual=False,
    max_initial_timestamp_index=50,
    return_timestamps=False,
    use_cache=True,
)

feature_extractor = WhisperFeatureExtractor(
    feature_size=config.num_mel_bins,
    sampling_rate=SAMPLING_RATE,
    hop_length=160,
    chunk_length=1,  # 1 s window = 100 mel frames = 2 * max_source_positions
    n_fft=400,
)

# three utterances of different lengths (0.35 s, 1.0 s, 0.6 s)
rng = np.random.default_rng(0)
audios = [
    (0.3 * rng.standard_normal(int(seconds * SAMPLING_RATE))).astype(np.float32)
    for seconds in (0.35, 1.0, 0.6)
]

# processor.get_prompt_ids(" previous words") -> [<|startofprev|>, " previous", " words"]
prompt_ids = torch.tensor([PREV, 17, 42, 5])

MAX_NEW_TOKENS = 12

inputs = feature_extractor(
    audios,
    sampling_rate=SAMPLING_RATE,
    padding="max_length",
    return_attention_mask=True,
    return_tensors="pt",
)
input_features = inputs.input_features.to(torch.float64)
assert input_features.shape == (3, config.num_mel_bins, 100)

with torch.no_grad():
    out = model.generate(
        input_features,
        attention_mask=inputs.attention_mask,
        prompt_ids=prompt_ids,
        max_new_tokens=MAX_NEW_TOKENS,
        return_dict_in_generate=True,
        output_scores=True,
    )
sequences = out.sequences
scores = torch.stack(out.scores, dim=1)  # (batch, steps, vocab)


def transcribe_alone(audio):
    """One audio, no batch, no cache: re-run the full decoder sequence every step."""
    features = feature_extractor(
        [audio], sampling_rate=SAMPLING_RATE, padding="max_length", return_tensors="pt"
    ).input_features.to(torch.float64)
    decoder_input_ids = torch.cat([prompt_ids, torch.tensor([SOT, NO_TIMESTAMPS])])[None]
    generated, step_logits = [], []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            logits = model(
                input_features=features, decoder_input_ids=decoder_input_ids, use_cache=False
            ).logits[0, -1]
            token = int(logits.argmax())
            generated.append(token)
            step_logits.append(logits)
            if token == EOT:
                break
            decoder_input_ids = torch.cat([decoder_input_ids, torch.tensor([[token]])], dim=-1)
    return generated, torch.stack(step_logits)


for row, audio in enumerate(audios):
    expected, expected_logits = transcribe_alone(audio)
    # short-form generate returns [prompt_ids, SOT, NO_TIMESTAMPS, text..., EOT, pad...]
    row_tokens = sequences[row].tolist()
    begin = len(prompt_ids) + 2
    assert row_tokens[:begin] == prompt_ids.tolist() + [SOT, NO_TIMESTAMPS], row_tokens
    got = row_tokens[begin : begin + len(expected)]
    assert got == expected, (row, got, expected)
    assert all(t == EOT for t in row_tokens[begin + len(expected) :]), row_tokens
    # generate hands its scores back in float32
    err = (scores[row, : len(expected)].double() - expected_logits).abs().max().item()
    assert err < 1e-5, (row, err)
    print(f"row {row}: {len(audio) / SAMPLING_RATE:.2f} s, "
          f"{int(inputs.attention_mask[row].sum())} mel frames, tokens {got}, max |dlogit| {err:.1e}")

print("batched cached generate with prompt_ids matches each audio decoded alone without a cache")
