// The assistant's page: microphone (the browser's echo cancellation on) -> Opus (WebCodecs)
// -> Ogg -> websocket /api/assistant; its answer's Ogg Opus -> decoder -> AudioWorklet
// player; both sides' words as they come. Kyutai's chat protocol (first byte = kind), with
// the assistant's events as 0x04 metadata: see moshi_mlx/serve/assistant/messages.py.
import { OggOpusWriter, OggPacketReader, concat, opusHead } from "./ogg.js";

const KIND = { handshake: 0, audio: 1, text: 2, control: 3, metadata: 4, error: 5, ping: 6 };
const MODEL_RATE = 24000;
const MIC_FRAME = 480; // 20 ms: browsers send 20 ms Opus frames
const MIC_CONSTRAINTS = {
  echoCancellation: true,
  noiseSuppression: true,
  autoGainControl: true,
  channelCount: 1,
};

const $ = (id) => document.getElementById(id);

// Everything measured and shown, readable from outside (the browser test reads it).
const stats = (window.assistantStats = {
  state: "idle",
  micFrames: 0,
  micSoundSamples: 0,
  sentSeconds: 0,
  receivedAudioMessages: 0,
  receivedSeconds: 0,
  playedSoundSamples: 0,
  underruns: 0,
  turns: [], // {role: "user" | "assistant", text, done, cutOff}
  latencies: [], // each answer's split, ms
  models: null,
  error: null,
});

let session = null;

function setState(state, label) {
  stats.state = state;
  $("state").textContent = label;
  $("state").className = `state ${state}`;
}

function showMessage(text) {
  $("message").hidden = !text;
  $("message").textContent = text || "";
  if (text) stats.error = text;
}

function missingFeature() {
  if (!window.isSecureContext) {
    return (
      "This page is not a secure context, so the browser withholds the microphone. Open it as " +
      "http://localhost:PORT on the computer running the server."
    );
  }
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    return "This browser gives no access to a microphone.";
  }
  if (!window.AudioWorkletNode) return "This browser lacks AudioWorklet (needed for playback).";
  if (!window.AudioEncoder || !window.AudioDecoder) {
    return "This browser lacks WebCodecs audio (Opus): use Chrome or Edge 94+, Firefox 130+ or Safari 26+.";
  }
  return null;
}

// --- the conversation as shown ---
function openTurn(role) {
  const last = stats.turns[stats.turns.length - 1];
  if (last && last.role === role && !last.done) return last;
  const turn = { role, text: "", done: false, cutOff: false };
  stats.turns.push(turn);
  return turn;
}

function lastOpen(role) {
  for (let i = stats.turns.length - 1; i >= 0; i--) {
    const turn = stats.turns[i];
    if (turn.role === role && !turn.done) return turn;
  }
  return null;
}

function onWords(role, words) {
  const turn = openTurn(role);
  turn.text = turn.text ? `${turn.text} ${words}` : words;
  render();
}

function onEvent(data) {
  if (data.user !== undefined) onWords("user", data.user);
  if (data.user_said !== undefined) {
    const turn = lastOpen("user") || openTurn("user");
    Object.assign(turn, { text: data.user_said, done: true });
  }
  if (data.answer_ended !== undefined) {
    let turn = lastOpen("assistant");
    if (!turn && data.answer_ended) {
      turn = { role: "assistant", text: "", done: false, cutOff: false };
      stats.turns.push(turn);
    }
    if (turn) Object.assign(turn, { text: data.answer_ended, done: true, cutOff: data.cut_off });
  }
  if (data.latency) {
    stats.latencies.push(data.latency);
    const split = Object.entries(data.latency)
      .filter(([stage]) => stage !== "total")
      .map(([stage, ms]) => `${stage.replaceAll("_", " ")} ${Math.round(ms)}`)
      .join(", ");
    $("latency").textContent = `${Math.round(data.latency.total)} ms`;
    $("latency").title = `${split} (ms; audio out ends as the server sends the audio)`;
  }
  if (data.notice) showMessage(data.notice);
  if (data.models) {
    stats.models = data.models;
    $("models").textContent = Object.values(data.models).filter(Boolean).join(" + ") || "–";
  }
  render();
}

function render() {
  const box = $("turns");
  box.replaceChildren(
    ...stats.turns.map((turn) => {
      const line = document.createElement("p");
      line.className = `turn ${turn.role}${turn.done ? "" : " partial"}${turn.cutOff ? " cut" : ""}`;
      const who = document.createElement("span");
      who.className = "who";
      who.textContent = turn.role === "user" ? "you" : "assistant";
      const text = document.createElement("span");
      text.className = "text";
      text.textContent = turn.text;
      line.append(who, text);
      return line;
    }),
  );
  box.scrollTop = box.scrollHeight;
}

// --- audio and the websocket ---
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

class Session {
  constructor() {
    this.handshake = false;
    this.decoder = null;
    this.oggIn = new OggPacketReader();
    this.oggOut = null;
    this.lastGranule = 0;
    this.micTimestamp = 0;
  }

  async start() {
    this.context = new AudioContext(); // before any await: Safari wants the click's gesture
    setState("waiting", "asking for the microphone…");
    try {
      this.stream = await navigator.mediaDevices.getUserMedia({ audio: MIC_CONSTRAINTS });
    } catch (error) {
      throw new Error(`Cannot open the microphone: ${error && (error.name || error.message)}`);
    }
    await this.context.audioWorklet.addModule("audio-worklet.js");
    await this.context.resume();
    this.player = new AudioWorkletNode(this.context, "moshi-player", {
      numberOfInputs: 0,
      outputChannelCount: [1],
      processorOptions: { startSeconds: 0.08, maxSeconds: 0.4 },
    });
    this.player.port.onmessage = (event) => {
      stats.playedSoundSamples = event.data.soundSamples;
      stats.underruns = event.data.underruns;
    };
    this.player.connect(this.context.destination);
    this.mic = new AudioWorkletNode(this.context, "moshi-mic", { numberOfOutputs: 0 });
    this.mic.port.onmessage = (event) => this.onMicFrame(event.data);
    this.context.createMediaStreamSource(this.stream).connect(this.mic);
    this.encoder = new AudioEncoder({
      output: (chunk, metadata) => this.onOpusPacket(chunk, metadata),
      error: (error) => this.fail(`The Opus encoder failed: ${error.message}`),
    });
    this.encoder.configure(await encoderConfig());
    this.connect();
    this.timer = setInterval(() => {
      $("mic").textContent = stats.micSoundSamples > 0 ? "on (echo cancellation)" : "silent";
    }, 250);
  }

  connect() {
    setState("waiting", "connecting…");
    const protocol = location.protocol === "https:" ? "wss:" : "ws:";
    // The page's own query (?auth_id=KEY) goes to the server.
    this.ws = new WebSocket(`${protocol}//${location.host}/api/assistant${location.search}`);
    this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => setState("waiting", "waiting for the assistant…");
    this.ws.onmessage = (event) => this.onMessage(new Uint8Array(event.data));
    this.ws.onclose = (event) => this.onClose(event);
  }

  onMessage(message) {
    if (message.length === 0) return;
    const payload = message.subarray(1);
    switch (message[0]) {
      case KIND.handshake:
        this.handshake = true;
        setState("live", "connected: talk to the assistant");
        break;
      case KIND.audio:
        stats.receivedAudioMessages++;
        this.onServerAudio(payload);
        break;
      case KIND.text:
        onWords("assistant", new TextDecoder().decode(payload).trim());
        break;
      case KIND.metadata:
        onEvent(JSON.parse(new TextDecoder().decode(payload)));
        break;
      case KIND.error:
        this.serverError = new TextDecoder().decode(payload);
        break;
      default: // ping, control: nothing to do
    }
  }

  onMicFrame({ frame, soundSamples }) {
    stats.micFrames++;
    stats.micSoundSamples = soundSamples;
    if (!this.handshake || this.encoder.state !== "configured") return;
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
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(concat([new Uint8Array([KIND.audio]), ...pages]));
      stats.sentSeconds += seconds;
    }
  }

  onServerAudio(bytes) {
    let packets;
    try {
      packets = this.oggIn.push(bytes);
    } catch (error) {
      this.fail(error.message);
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
      output: (audio) => {
        const samples = new Float32Array(audio.numberOfFrames);
        audio.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
        stats.receivedSeconds += audio.numberOfFrames / audio.sampleRate;
        this.player.port.postMessage({ samples, rate: audio.sampleRate }, [samples.buffer]);
        audio.close();
      },
      error: (error) => this.fail(`The Opus decoder failed: ${error.message}`),
    });
    const view = new DataView(head.buffer, head.byteOffset);
    this.decoder.configure({
      codec: "opus",
      sampleRate: view.getUint32(12, true) || MODEL_RATE,
      numberOfChannels: 1,
      description: head,
    });
  }

  fail(text) {
    this.failed = true;
    showMessage(text);
    this.stop(false);
  }

  onClose(event) {
    const wasLive = this.handshake;
    this.stop(false);
    if (this.closedByUser || this.failed) return;
    let text;
    if (this.serverError && this.serverError.startsWith("busy")) {
      text = "The assistant is talking with someone else (one conversation at a time). Try again later.";
    } else if (this.serverError) {
      text = `The server closed the connection: ${this.serverError}`;
    } else if (wasLive) {
      text = "The connection was closed. Press Start to talk again.";
    } else {
      text = `Could not reach the assistant at ${location.host} (code ${event.code}). Is the server running with --stt, --tts and --llm?`;
    }
    showMessage(text);
    setState("closed", "connection closed");
  }

  stop(byUser) {
    if (byUser) this.closedByUser = true;
    clearInterval(this.timer);
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close();
    if (this.stream) this.stream.getTracks().forEach((track) => track.stop());
    for (const codec of [this.encoder, this.decoder]) {
      if (codec && codec.state !== "closed") codec.close();
    }
    if (this.mic) this.mic.port.postMessage("stop");
    if (this.context && this.context.state !== "closed") this.context.close();
    if (session === this) {
      session = null;
      $("start").textContent = "Start";
      $("start").classList.remove("stop");
    }
    if (byUser) setState("idle", "stopped");
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

async function toggle() {
  if (session) {
    session.stop(true);
    return;
  }
  showMessage(null);
  stats.error = null;
  const missing = missingFeature();
  if (missing) {
    showMessage(missing);
    return;
  }
  session = new Session();
  $("start").textContent = "Stop";
  $("start").classList.add("stop");
  try {
    await session.start();
  } catch (error) {
    if (session) session.stop(false);
    showMessage(error.message);
    setState("closed", "not connected");
  }
}

$("start").addEventListener("click", toggle);
