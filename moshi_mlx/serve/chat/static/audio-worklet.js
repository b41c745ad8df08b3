// AudioWorklet processors of the page: the microphone tap and Moshi's player.
// Both run on the browser's audio thread; they only copy samples and count them.

const MODEL_RATE = 24000;
const MIC_FRAME = 480; // 20 ms at 24 kHz: one Opus frame
const SILENCE = 1e-3; // |sample| above this counts as sound

/** Streaming linear-interpolation resampler with a box pre-filter when downsampling. */
class LinearResampler {
  constructor(inRate, outRate) {
    this.step = inRate / outRate;
    this.position = 0; // of the next output, in input samples after `previous`
    this.previous = 0;
    this.box = new Float32Array(Math.max(1, Math.round(this.step)));
    this.boxIndex = 0;
    this.boxSum = 0;
    this.out = new Float32Array(0);
  }

  /** Resampled samples (a view, valid until the next call). */
  process(input) {
    const needed = Math.ceil(input.length / this.step) + 2;
    if (this.out.length < needed) this.out = new Float32Array(needed);
    let n = 0;
    for (let i = 0; i < input.length; i++) {
      this.boxSum += input[i] - this.box[this.boxIndex];
      this.box[this.boxIndex] = input[i];
      this.boxIndex = (this.boxIndex + 1) % this.box.length;
      const current = this.boxSum / this.box.length;
      while (this.position <= 1) {
        this.out[n++] = this.previous + (current - this.previous) * this.position;
        this.position += this.step;
      }
      this.position -= 1;
      this.previous = current;
    }
    return this.out.subarray(0, n);
  }
}

function countSound(samples) {
  let count = 0;
  for (let i = 0; i < samples.length; i++) if (Math.abs(samples[i]) > SILENCE) count++;
  return count;
}

/** Microphone in, 20 ms frames of 24 kHz float32 out to the page (port messages). */
class MicProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.resampler = new LinearResampler(sampleRate, MODEL_RATE);
    this.frame = new Float32Array(MIC_FRAME);
    this.filled = 0;
    this.soundSamples = 0;
    this.port.onmessage = (event) => {
      if (event.data === "stop") this.stopped = true;
    };
  }

  process(inputs) {
    if (this.stopped) return false;
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    const samples = this.resampler.process(channel);
    this.soundSamples += countSound(samples);
    for (let i = 0; i < samples.length; i++) {
      this.frame[this.filled++] = samples[i];
      if (this.filled === MIC_FRAME) {
        this.port.postMessage({ frame: this.frame, soundSamples: this.soundSamples }, [
          this.frame.buffer,
        ]);
        this.frame = new Float32Array(MIC_FRAME);
        this.filled = 0;
      }
    }
    return true;
  }
}

/**
 * Moshi's audio through a small jitter buffer: playback starts once `startSeconds` are queued,
 * pauses (and refills) on an underrun, and drops the oldest audio beyond `maxSeconds` so a burst
 * never turns into lasting delay.
 */
class PlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { startSeconds = 0.08, maxSeconds = 0.4 } = options.processorOptions || {};
    this.startFrames = Math.round(startSeconds * sampleRate);
    this.maxFrames = Math.round(maxSeconds * sampleRate);
    this.ring = new Float32Array(Math.round(4 * sampleRate));
    this.read = 0;
    this.size = 0;
    this.playing = false;
    this.resamplers = new Map();
    this.stats = { underruns: 0, droppedSeconds: 0, soundSamples: 0, playedSamples: 0 };
    this.sinceReport = 0;
    this.port.onmessage = (event) => this.enqueue(event.data);
  }

  enqueue({ samples, rate }) {
    if (!this.resamplers.has(rate)) {
      this.resamplers.set(rate, new LinearResampler(rate, sampleRate));
    }
    const resampled = this.resamplers.get(rate).process(samples);
    for (let i = 0; i < resampled.length; i++) {
      if (this.size === this.ring.length) this.drop(1);
      this.ring[(this.read + this.size) % this.ring.length] = resampled[i];
      this.size++;
    }
    if (this.size > this.maxFrames) this.drop(this.size - this.startFrames);
  }

  drop(frames) {
    this.read = (this.read + frames) % this.ring.length;
    this.size -= frames;
    this.stats.droppedSeconds += frames / sampleRate;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing && this.size >= this.startFrames) this.playing = true;
    let i = 0;
    if (this.playing) {
      for (; i < out.length && this.size > 0; i++) {
        out[i] = this.ring[this.read];
        this.read = (this.read + 1) % this.ring.length;
        this.size--;
      }
      this.stats.soundSamples += countSound(out.subarray(0, i));
      this.stats.playedSamples += i;
      if (i < out.length) {
        this.playing = false;
        this.stats.underruns++;
      }
    }
    out.fill(0, i);
    this.sinceReport += out.length;
    if (this.sinceReport >= sampleRate / 10) {
      this.sinceReport = 0;
      this.port.postMessage({ ...this.stats, bufferedSeconds: this.size / sampleRate });
    }
    return true;
  }
}

registerProcessor("moshi-mic", MicProcessor);
registerProcessor("moshi-player", PlayerProcessor);
