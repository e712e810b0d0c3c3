"""Pop2Piano (pop audio -> piano MIDI tokens): several clips of different lengths
transcribed in one batch. Each clip is cut into beat-aligned chunks (2 bars) whose
log-mel frames are the rows the T5 encoder reads; the clips are padded to the longest
chunk in frames and a zero "separator" row is appended after each clip; a composer
embedding is put in front of every row and the frame mask gets a column for it; the T5
decoder cross-attends the encoded rows under that mask while it generates.

Ported from huggingface/transformers as installed (transformers 5.25.0; the stored copy
of the repository read was commit 23925e160765f64e73942fe794d73a753c4b5732):
  src/transformers/models/pop2piano/feature_extraction_pop2piano.py
      Pop2PianoFeatureExtractor.interpolate_beat_times, preprocess_mel, mel_spectrogram,
      _pad (frames right-padded with padding_value, mask 1 on real frames, a zero line
      with an all-zero mask row after each clip), pad, __call__ (log of clipped mel)
  src/transformers/models/pop2piano/modeling_pop2piano.py
      Pop2PianoForConditionalGeneration.get_mel_conditioner_outputs / generate, used as is
      from a tiny Pop2PianoConfig (rows whose first mask entry is 0 are zeroed; the mask
      gets attention_mask[:, 0] in front for the composer token)
Beat tracking (essentia's RhythmExtractor2013) is replaced by beat times at a fixed tempo
per clip, and the sizes (sampling rate, window, mel bins) are made small; the processor's
MIDI decoding (pretty_midi) is left out: its split of the generated rows by clip is kept.

Checked against a reference: every clip featurized and generated alone (is_batched=False,
no mask, no zero line, as the extractor returns one clip), greedy tokens equal; and in
float64 the encoder states of the real frames and the teacher-forced decoder logits of
every real row equal those of the clip alone.
"""
import numpy as np
import torch
from transformers import GenerationConfig, Pop2PianoConfig, Pop2PianoForConditionalGeneration
from transformers.audio_utils import mel_filter_bank, spectrogram

torch.manual_seed(0)
torch.set_num_threads(1)


class Pop2PianoFeatureExtractor:
    """feature_extraction_pop2piano.py, without the essentia / librosa parts."""

    def __init__(self, sampling_rate=4000, padding_value=0, window_size=256, hop_length=64,
                 min_frequency=10.0, feature_size=32, num_bars=2):
        self.sampling_rate = sampling_rate
        self.padding_value = padding_value
        self.window_size = window_size
        self.hop_length = hop_length
        self.min_frequency = min_frequency
        self.feature_size = feature_size
        self.num_bars = num_bars
        self.mel_filters = mel_filter_bank(
            num_frequency_bins=(self.window_size // 2) + 1,
            num_mel_filters=self.feature_size,
            min_frequency=self.min_frequency,
            max_frequency=float(self.sampling_rate // 2),
            sampling_rate=self.sampling_rate,
            norm=None,
            mel_scale="htk",
        )

    def mel_spectrogram(self, sequence):
        mel_specs = []
        for seq in sequence:
            window = np.hanning(self.window_size + 1)[:-1]
            mel_specs.append(
                spectrogram(
                    waveform=seq,
                    window=window,
                    frame_length=self.window_size,
                    hop_length=self.hop_length,
                    power=2.0,
                    mel_filters=self.mel_filters,
                )
            )
        return np.array(mel_specs)

    def interpolate_beat_times(self, beat_times, steps_per_beat, n_extend):
        # scipy.interpolate.interp1d(..., bounds_error=False, fill_value="extrapolate") upstream; its linear
        # interpolation with the end segments extended, in numpy (the test environment holds no scipy)
        x = np.arange(beat_times.size)
        new_x = np.linspace(0, beat_times.size + n_extend - 1, beat_times.size * steps_per_beat + n_extend)
        out = np.interp(new_x, x, beat_times)
        lo, hi = new_x < x[0], new_x > x[-1]
        out[lo] = beat_times[0] + (new_x[lo] - x[0]) * (beat_times[1] - beat_times[0]) / (x[1] - x[0])
        out[hi] = beat_times[-1] + (new_x[hi] - x[-1]) * (beat_times[-1] - beat_times[-2]) / (x[-1] - x[-2])
        return out

    def preprocess_mel(self, audio, beatstep):
        if beatstep[0] > 0.0:
            beatstep = beatstep - beatstep[0]

        num_steps = self.num_bars * 4
        num_target_steps = len(beatstep)
        extrapolated_beatstep = self.interpolate_beat_times(
            beat_times=beatstep, steps_per_beat=1, n_extend=(self.num_bars + 1) * 4 + 1
        )

        sample_indices = []
        max_feature_length = 0
        for i in range(0, num_target_steps, num_steps):
            start_idx = i
            end_idx = min(i + num_steps, num_target_steps)
            start_sample = int(extrapolated_beatstep[start_idx] * self.sampling_rate)
            end_sample = int(extrapolated_beatstep[end_idx] * self.sampling_rate)
            sample_indices.append((start_sample, end_sample))
            max_feature_length = max(max_feature_length, end_sample - start_sample)
        padded_batch = []
        for start_sample, end_sample in sample_indices:
            feature = audio[start_sample:end_sample]
            padded_feature = np.pad(
                feature, ((0, max_feature_length - feature.shape[0]),), "constant", constant_values=0
            )
            padded_batch.append(padded_feature)

        return np.asarray(padded_batch), extrapolated_beatstep

    def _pad(self, features, add_zero_line=True):
        features_shapes = [each_feature.shape for each_feature in features]
        attention_masks, padded_features = [], []
        for i, each_feature in enumerate(features):
            features_pad_value = max([*zip(*features_shapes)][1]) - features_shapes[i][1]
            attention_mask = np.ones(features_shapes[i][:2], dtype=np.int64)
            feature_padding = ((0, 0), (0, features_pad_value), (0, 0))
            attention_mask_padding = (feature_padding[0], feature_padding[1])

            each_padded_feature = np.pad(each_feature, feature_padding, "constant", constant_values=self.padding_value)
            attention_mask = np.pad(attention_mask, attention_mask_padding, "constant", constant_values=self.padding_value)

            if add_zero_line:
                # if it is batched then we separate each examples using zero array
                zero_array_len = max([*zip(*features_shapes)][1])
                each_padded_feature = np.concatenate(
                    [each_padded_feature, np.zeros([1, zero_array_len, self.feature_size])], axis=0
                )
                attention_mask = np.concatenate(
                    [attention_mask, np.zeros([1, zero_array_len], dtype=attention_mask.dtype)], axis=0
                )

            padded_features.append(each_padded_feature)
            attention_masks.append(attention_mask)

        padded_features = np.concatenate(padded_features, axis=0).astype(np.float32)
        attention_masks = np.concatenate(attention_masks, axis=0).astype(np.int64)
        return padded_features, attention_masks

    def __call__(self, audio, beatsteps, is_batched, return_attention_mask):
        batch_input_features = []
        for single_raw_audio, single_beatsteps in zip(audio, beatsteps):
            start_sample = int(single_beatsteps[0] * self.sampling_rate)
            end_sample = int(single_beatsteps[-1] * self.sampling_rate)
            input_features, _ = self.preprocess_mel(
                single_raw_audio[start_sample:end_sample], single_beatsteps - single_beatsteps[0]
            )
            mel_specs = self.mel_spectrogram(input_features.astype(np.float32))
            log_mel_specs = np.log(np.clip(mel_specs, a_min=1e-6, a_max=None))
            batch_input_features.append(np.transpose(log_mel_specs, (0, -1, -2)))

        input_features, attention_mask = self._pad(batch_input_features, add_zero_line=True)
        out = {"input_features": torch.from_numpy(input_features)}
        if return_attention_mask:
            out["attention_mask"] = torch.from_numpy(attention_mask)
        elif not is_batched:
            # one clip: the zero line that separates clips is dropped
            out["input_features"] = out["input_features"][:-1, ...]
        return out


def make_clip(seconds, bpm, sr, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    audio = 0.3 * np.sin(2 * np.pi * 220.0 * (1 + 0.5 * rng.random()) * t) + 0.05 * rng.standard_normal(t.size)
    beat = 60.0 / bpm
    beatsteps = np.arange(0.0, seconds - beat, beat)
    return audio.astype(np.float32), beatsteps


def rows_per_clip(attention_mask):
    """Processor.batch_decode: the all-zero rows end each clip."""
    ends = torch.nonzero(attention_mask[:, 0] == 0).flatten().tolist()
    start, out = 0, []
    for end in ends:
        out.append(list(range(start, end)))
        start = end + 1
    return out


def main():
    fe = Pop2PianoFeatureExtractor()
    composer_to_feature_token = {f"composer{i + 1}": 2000 + i for i in range(4)}
    config = Pop2PianoConfig(
        vocab_size=96, composer_vocab_size=4, d_model=fe.feature_size, d_kv=8, d_ff=64,
        num_layers=2, num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=32, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    )
    model = Pop2PianoForConditionalGeneration(config).eval()
    generation_config = GenerationConfig(
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, max_new_tokens=12, do_sample=False,
    )
    generation_config.composer_to_feature_token = composer_to_feature_token

    clips = [make_clip(7.0, 120, fe.sampling_rate, 1), make_clip(4.4, 96, fe.sampling_rate, 2),
             make_clip(5.5, 140, fe.sampling_rate, 3)]
    audio = [c[0] for c in clips]
    beatsteps = [c[1] for c in clips]

    batch = fe(audio, beatsteps, is_batched=True, return_attention_mask=True)
    frames = batch["attention_mask"].sum(-1).tolist()
    print("rows x frames:", tuple(batch["input_features"].shape[:2]), "real frames per row:", frames)
    assert 0 in batch["attention_mask"][:, -1].tolist()  # some clip is padded in frames

    out = model.generate(
        input_features=batch["input_features"], attention_mask=batch["attention_mask"],
        composer="composer2", generation_config=generation_config,
    )
    groups = rows_per_clip(batch["attention_mask"])
    assert len(groups) == len(clips)

    for i in range(len(clips)):
        alone = fe([audio[i]], [beatsteps[i]], is_batched=False, return_attention_mask=False)
        ref = model.generate(input_features=alone["input_features"], composer="composer2",
                             generation_config=generation_config)
        got = out[groups[i]]
        width = max(got.shape[1], ref.shape[1])
        got = torch.nn.functional.pad(got, (0, width - got.shape[1]), value=0)
        ref = torch.nn.functional.pad(ref, (0, width - ref.shape[1]), value=0)
        assert torch.equal(got, ref), (i, got, ref)
        print(f"clip {i}: {len(groups[i])} rows, tokens of the batch equal the clip alone")

    # float64: encoder states of real frames and teacher-forced logits of every real row
    model.double()
    labels = torch.randint(2, config.vocab_size, (batch["input_features"].shape[0], 6))
    embeds, mask = model.get_mel_conditioner_outputs(
        batch["input_features"].double(), "composer2", generation_config, batch["attention_mask"]
    )
    with torch.no_grad():
        res = model(inputs_embeds=embeds, attention_mask=mask, labels=labels)
    worst = 0.0
    for i in range(len(clips)):
        alone = fe([audio[i]], [beatsteps[i]], is_batched=False, return_attention_mask=False)
        emb_i, _ = model.get_mel_conditioner_outputs(alone["input_features"].double(), "composer2", generation_config)
        with torch.no_grad():
            res_i = model(inputs_embeds=emb_i, labels=labels[groups[i]])
        n = emb_i.shape[1]
        enc = res.encoder_last_hidden_state[groups[i], :n]
        worst = max(worst, (enc - res_i.encoder_last_hidden_state).abs().max().item())
        worst = max(worst, (res.logits[groups[i]] - res_i.logits).abs().max().item())
    print(f"float64 max |batched - alone| over encoder states and logits: {worst:.1e}")
    assert worst < 1e-10


if __name__ == "__main__":
    main()
