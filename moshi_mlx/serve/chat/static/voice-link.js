// What both pages (chat and assistant) share: the audio (`VoiceLink`: microphone -> Opus
// (WebCodecs) -> Ogg pages for the websocket, the server's Ogg Opus -> decoder -> AudioWorklet
// player), the websocket side of a conversation (`VoiceSession`), the Start/Stop button
// (`StartStop`), Kyutai's chat protocol kinds and the state and message display. What a page
// shows and sends stays in the page, through callbacks and a `VoiceSession` subclass.
import { OggOpusWriter, OggPacketReader, concat, opusHead } from "./ogg.js";

export const KIND = { handshake: 0, audio: 1, text: 2, control: 3, metadata: 4, error: 5, ping: 6 };
export const MODEL_RATE = 24000;
const MIC_FRAME = 480; // 20 ms: browsers send 20 ms Opus frames
const MIC_CONSTRAINTS = {
  echoCancellation: true,
  noiseSuppression: true,
  autoGainControl: true,
  channelCount: 1,
};

export const $ = (id) => document.getElementById(id);

// The page's #state and #message elements, mirrored in `stats` (state, error).
export function statusDisplay(stats) {
  return {
    setState(state, label) {
      stats.state = state;
      $("state").textContent = label;
      $("state").className = `state ${state}`;
    },
    showMessage(text) {
      $("message").hidden = !text;
      $("message").textContent = text || "";
      if (text) stats.error = text;
    },
  };
}

// Why this browser cannot run a page (the page's own words for the two likeliest reasons),
// or null.
export function missingFeature({ insecure, noWebCodecs }) {
  if (!window.isSecureContext) return insecure;
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    return "This browser gives no access to a microphone.";
  }
  if (!window.AudioWorkletNode) return "This browser lacks AudioWorklet (needed for playback).";
  if (!window.AudioEncoder || !window.AudioDecoder) return noWebCodecs;
  return null;
}

async function encoderConfig() {
  const base = { codec: "opus", sampleRate: MODEL_RATE, numberOfChannels: 1, bitrate: 32000 };
  const withFrames = { ...base, opus: { frameDuration: 20000, application: "voip" } };
  for (const config of [withFrames, base]) {
    try {
      if ((await AudioEncoder.isConfigSupported(config)).supported) return config;
    } catch (_) {
      // an unknown member is a TypeError in some browsers: try the plainer config
    }
  }
  throw new Error("this browser cannot encode Opus at 24 kHz");
}

// One conversation's audio. It counts in `stats` the mic frames (micFrames), the sound in the
// last one (micSoundSamples) and the seconds handed to the player (receivedSeconds); the rest
// goes through callbacks: onPages(bytes, seconds): an audio message (kind byte and Ogg pages)
// to send; onPlayer(data): the player's stats; onError(text): the codecs or the server's Ogg
// failed; microphoneProblem(error): the text for a refused microphone.
// Mic frames are encoded only while `sending` is true (set it on the server's handshake).
export class VoiceLink {
  constructor(stats, callbacks) {
    this.stats = stats;
    this.callbacks = callbacks;
    this.sending = false;
    this.decoder = null;
    this.oggIn = new OggPacketReader();
    this.oggOut = null;
    this.lastGranule = 0;
    this.micTimestamp = 0;
    // Made before any await, while the click still counts as a user gesture (Safari lets
    // audio start only then).
    this.context = new AudioContext();
  }

  // Microphone, player and encoder, ready; throws (the microphone's problem) if they are not.
  async open() {
    try {
      this.stream = await navigator.mediaDevices.getUserMedia({ audio: MIC_CONSTRAINTS });
    } catch (error) {
      throw new Error(this.callbacks.microphoneProblem(error));
    }
    await this.context.audioWorklet.addModule("audio-worklet.js");
    await this.context.resume();
    this.player = new AudioWorkletNode(this.context, "moshi-player", {
      numberOfInputs: 0,
      outputChannelCount: [1],
      processorOptions: { startSeconds: 0.08, maxSeconds: 0.4 },
    });
    this.player.port.onmessage = (event) => this.callbacks.onPlayer(event.data);
    this.player.connect(this.context.destination);
    this.mic = new AudioWorkletNode(this.context, "moshi-mic", { numberOfOutputs: 0 });
    this.mic.port.onmessage = (event) => this.onMicFrame(event.data);
    this.context.createMediaStreamSource(this.stream).connect(this.mic);
    const config = await encoderConfig();
    this.encoder = new AudioEncoder({
      output: (chunk, metadata) => this.onOpusPacket(chunk, metadata),
      error: (error) => this.callbacks.onError(`The Opus encoder failed: ${error.message}`),
    });
    this.encoder.configure(config);
  }

  onMicFrame({ frame, soundSamples }) {
    this.stats.micFrames++;
    this.stats.micSoundSamples = soundSamples;
    if (!this.sending || this.encoder.state !== "configured") return;
    const data = new AudioData({
      format: "f32-planar",
      sampleRate: MODEL_RATE,
      numberOfFrames: frame.length,
      numberOfChannels: 1,
      timestamp: Math.round((this.micTimestamp * 1e6) / MODEL_RATE),
      data: frame,
    });
    this.micTimestamp += frame.length;
    this.encoder.encode(data);
    data.close();
  }

  onOpusPacket(chunk, metadata) {
    const packet = new Uint8Array(chunk.byteLength);
    chunk.copyTo(packet);
    const pages = [];
    if (!this.oggOut) {
      const description = metadata && metadata.decoderConfig && metadata.decoderConfig.description;
      this.oggOut = new OggOpusWriter(encoderHead(description));
      pages.push(this.oggOut.headers());
    }
    const seconds = chunk.duration ? chunk.duration / 1e6 : MIC_FRAME / MODEL_RATE;
    pages.push(this.oggOut.packet(packet, Math.round(seconds * 48000)));
    this.callbacks.onPages(concat([new Uint8Array([KIND.audio]), ...pages]), seconds);
  }

  // The payload of a 0x01 message from the server: Ogg pages of Opus, to the player.
  play(bytes) {
    let packets;
    try {
      packets = this.oggIn.push(bytes);
    } catch (error) {
      this.callbacks.onError(error.message);
      return;
    }
    for (const { packet, granule } of packets) {
      if (startsWith(packet, "OpusHead")) {
        this.startDecoder(packet);
      } else if (!startsWith(packet, "OpusTags") && this.decoder) {
        const timestamp = Math.round((this.lastGranule * 1e6) / 48000);
        if (granule >= 0) this.lastGranule = granule;
        this.decoder.decode(new EncodedAudioChunk({ type: "key", timestamp, data: packet }));
      }
    }
  }

  startDecoder(head) {
    this.decoder = new AudioDecoder({
      output: (audio) => this.onDecodedAudio(audio),
      error: (error) => this.callbacks.onError(`The Opus decoder failed: ${error.message}`),
    });
    const view = new DataView(head.buffer, head.byteOffset);
    this.decoder.configure({
      codec: "opus",
      sampleRate: view.getUint32(12, true) || MODEL_RATE,
      numberOfChannels: 1,
      description: head,
    });
  }

  onDecodedAudio(audio) {
    const samples = new Float32Array(audio.numberOfFrames);
    audio.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
    this.stats.receivedSeconds += audio.numberOfFrames / audio.sampleRate;
    this.player.port.postMessage({ samples, rate: audio.sampleRate }, [samples.buffer]);
    audio.close();
  }

  // Microphone, codecs and audio context released; safe to call twice or half open.
  close() {
    if (this.stream) this.stream.getTracks().forEach((track) => track.stop());
    for (const codec of [this.encoder, this.decoder]) {
      if (codec && codec.state !== "closed") codec.close();
    }
    if (this.mic) this.mic.port.postMessage("stop");
    if (this.context && this.context.state !== "closed") this.context.close();
  }
}

function encoderHead(description) {
  if (description) {
    const bytes = ArrayBuffer.isView(description)
      ? new Uint8Array(description.buffer, description.byteOffset, description.byteLength)
      : new Uint8Array(description);
    if (startsWith(bytes, "OpusHead")) return bytes;
  }
  return opusHead(MODEL_RATE, 312);
}

function startsWith(bytes, text) {
  if (bytes.length < text.length) return false;
  for (let i = 0; i < text.length; i++) if (bytes[i] !== text.charCodeAt(i)) return false;
  return true;
}

// One conversation: the websocket and its `VoiceLink` (`this.link`, made by `start()`). A page
// subclasses it for what it shows: `start()`, `onLive()`, `onText(text)`, `onMetadata(data)`,
// `closeText(wasLive, code)` (why the connection closed, for the user). `StartStop` sets
// `onStopped`. `stats.receivedAudioMessages` counts the server's audio messages.
export class VoiceSession {
  constructor(stats, display) {
    this.stats = stats;
    this.display = display;
    this.closedByUser = false;
    this.handshake = false;
    this.onStopped = () => {};
  }

  connect(url, waitingLabel) {
    this.display.setState("waiting", "connecting…");
    this.ws = new WebSocket(url);
    this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => this.display.setState("waiting", waitingLabel);
    this.ws.onmessage = (event) => this.onMessage(new Uint8Array(event.data));
    this.ws.onclose = (event) => this.onClose(event);
  }

  onMessage(message) {
    if (message.length === 0) return;
    const payload = message.subarray(1);
    switch (message[0]) {
      case KIND.handshake:
        this.handshake = true;
        this.link.sending = true;
        this.onLive();
        break;
      case KIND.audio:
        this.stats.receivedAudioMessages++;
        this.link.play(payload);
        break;
      case KIND.text:
        this.onText(new TextDecoder().decode(payload));
        break;
      case KIND.metadata:
        this.onMetadata(JSON.parse(new TextDecoder().decode(payload)));
        break;
      case KIND.error:
        this.serverError = new TextDecoder().decode(payload);
        break;
      default: // ping, control: nothing to do
    }
  }

  fail(text) {
    this.failed = true;
    this.display.showMessage(text);
    this.stop(false);
  }

  onClose(event) {
    const wasLive = this.handshake;
    this.stop(false);
    if (this.closedByUser || this.failed) return;
    this.display.showMessage(this.closeText(wasLive, event.code));
    this.display.setState("closed", "connection closed");
  }

  stop(byUser) {
    if (byUser) this.closedByUser = true;
    clearInterval(this.timer);
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close();
    if (this.link) this.link.close();
    this.onStopped();
    if (byUser) this.display.setState("idle", "stopped");
  }
}

// The Start/Stop button's click (`toggle`): stop the running session, or check the browser
// (`missing`: the page's words, see `missingFeature`) and start one that `makeSession()`
// makes; `showRunning(running)` shows which on the page.
export class StartStop {
  constructor({ stats, display, missing, makeSession, showRunning }) {
    Object.assign(this, { stats, display, missing, makeSession, showRunning });
    this.session = null;
  }

  async toggle() {
    if (this.session) {
      this.session.stop(true);
      return;
    }
    this.display.showMessage(null);
    this.stats.error = null;
    const missing = missingFeature(this.missing);
    if (missing) {
      this.display.showMessage(missing);
      return;
    }
    const session = this.makeSession();
    session.onStopped = () => {
      if (this.session !== session) return;
      this.session = null;
      this.showRunning(false);
    };
    this.session = session;
    this.showRunning(true);
    try {
      await session.start();
    } catch (error) {
      if (this.session) this.session.stop(false);
      this.display.showMessage(error.message);
      this.display.setState("closed", "not connected");
    }
  }
}
