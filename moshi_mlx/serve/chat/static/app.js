// The page: microphone -> Opus (WebCodecs) -> Ogg -> websocket; websocket -> Ogg -> Opus
// decoder -> AudioWorklet player. Kyutai's chat protocol, see moshi_mlx/web/protocol.py.
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
const LAG_MEMORY_MS = 5000; // "falling behind" stays on this long after the server drops audio

const $ = (id) => document.getElementById(id);

// Everything measured, readable from outside (the end-to-end test reads it over DevTools).
const stats = (window.moshiStats = {
  state: "idle",
  micFrames: 0,
  micSoundSamples: 0,
  sentMessages: 0,
  sentSeconds: 0,
  receivedAudioMessages: 0,
  receivedSeconds: 0,
  playedSoundSamples: 0,
  playedSamples: 0,
  underruns: 0,
  bufferedSeconds: 0,
  droppedByServer: 0, // mic frames the server skipped to keep up
  frameSeconds: 0, // one model frame, from the server's start metadata (frame_ms)
  latencyMs: null,
  text: "",
  error: null,
  voices: null, // PersonaPlex: the voices the server offers (null: Moshi, no persona)
  chatUrl: null, // the last connection's URL
});

let session = null;
// PersonaPlex: what the server lets us choose (GET /api/persona); null for Moshi.
let persona = null;

function setState(state, label) {
  stats.state = state;
  const element = $("state");
  element.textContent = label;
  element.className = `state ${state}`;
}

function showMessage(text) {
  const element = $("message");
  element.hidden = !text;
  element.textContent = text || "";
  if (text) stats.error = text;
}

function missingFeature() {
  if (!window.isSecureContext) {
    return (
      "This page is not a secure context, so the browser withholds the microphone. Open it as " +
      "http://localhost:PORT on the computer running Moshi, or start the server with --ssl DIR " +
      "and use https:// from other devices."
    );
  }
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    return "This browser gives no access to a microphone.";
  }
  if (!window.AudioWorkletNode) return "This browser lacks AudioWorklet (needed for playback).";
  if (!window.AudioEncoder || !window.AudioDecoder) {
    return (
      "This browser lacks WebCodecs audio (AudioEncoder/AudioDecoder), which the page uses for " +
      "Opus: use Chrome or Edge 94+, Firefox 130+ or Safari 26+."
    );
  }
  return null;
}

function chatUrl() {
  const protocol = location.protocol === "https:" ? "wss:" : "ws:";
  // The page's own query (?text_temperature=0.5&text_seed=1 ...) goes to the server.
  if (!persona) return `${protocol}//${location.host}/api/chat${location.search}`;
  // PersonaPlex: NVIDIA's parameters, only where the choice is not the server's default.
  const query = new URLSearchParams(location.search);
  const voice = $("voice").value;
  if (voice && voice !== persona.default_voice) query.set("voice_prompt", voice);
  else query.delete("voice_prompt");
  const role = oneLine($("role").value);
  if (role !== oneLine(persona.default_role)) query.set("text_prompt", role);
  else query.delete("text_prompt");
  const search = query.toString();
  return `${protocol}//${location.host}/api/chat${search ? `?${search}` : ""}`;
}

function oneLine(text) {
  return text.replace(/\s+/g, " ").trim(); // the server takes no line breaks in a role
}

async function loadPersona() {
  for (;;) {
    let response;
    try {
      response = await fetch("/api/persona");
    } catch (_) {
      return;
    }
    if (response.status === 503) {
      const body = await response.json().catch(() => ({}));
      if (!body.loading) return;
      await new Promise((resolve) => setTimeout(resolve, 1000)); // the model is loading
      continue;
    }
    if (!response.ok) return; // another server (--static with Kyutai's): no persona
    const data = await response.json();
    if (data.prompted) showPersona(data);
    return;
  }
}

function showPersona(data) {
  const query = new URLSearchParams(location.search);
  const voice = $("voice");
  if (!data.voices.includes(data.default_voice)) {
    voice.add(new Option(`${data.default_voice} (the server's voice)`, "")); // a file
  }
  for (const name of data.voices) voice.add(new Option(name, name));
  const asked = (query.get("voice_prompt") || "").replace(/\.pt$/, "");
  if (data.voices.includes(asked)) voice.value = asked;
  else voice.value = data.voices.includes(data.default_voice) ? data.default_voice : "";
  const role = $("role");
  role.maxLength = data.max_role_chars;
  role.value = query.has("text_prompt") ? query.get("text_prompt") : data.default_role;
  const examples = $("examples");
  for (const text of [data.default_role, ...data.example_roles]) {
    const label = text.length > 70 ? `${text.slice(0, 67)}…` : text;
    examples.add(new Option(label, text));
  }
  examples.addEventListener("change", () => {
    if (examples.value) role.value = examples.value;
    examples.value = "";
  });
  persona = data;
  stats.voices = data.voices;
  $("persona").hidden = false;
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

class Session {
  constructor() {
    this.closedByUser = false;
    this.handshake = false;
    this.lastLagAt = -Infinity;
    this.decoder = null;
    this.oggIn = new OggPacketReader();
    this.lastGranule = 0;
  }

  async start() {
    // Made before the first await, while the click still counts as a user gesture (Safari
    // lets audio start only then).
    this.context = new AudioContext();
    setState("waiting", "asking for the microphone…");
    try {
      this.stream = await navigator.mediaDevices.getUserMedia({ audio: MIC_CONSTRAINTS });
    } catch (error) {
      throw new Error(microphoneProblem(error));
    }
    await this.context.audioWorklet.addModule("audio-worklet.js");
    await this.context.resume();
    this.player = new AudioWorkletNode(this.context, "moshi-player", {
      numberOfInputs: 0,
      outputChannelCount: [1],
      processorOptions: { startSeconds: 0.08, maxSeconds: 0.4 },
    });
    this.player.port.onmessage = (event) => Object.assign(stats, playerStats(event.data));
    this.player.connect(this.context.destination);
    this.mic = new AudioWorkletNode(this.context, "moshi-mic", { numberOfOutputs: 0 });
    this.mic.port.onmessage = (event) => this.onMicFrame(event.data);
    this.source = this.context.createMediaStreamSource(this.stream);
    this.source.connect(this.mic);
    await this.startEncoder();
    this.connect();
    this.timer = setInterval(() => this.showStats(), 250);
  }

  async startEncoder() {
    const config = await encoderConfig();
    this.oggOut = null;
    this.encoder = new AudioEncoder({
      output: (chunk, metadata) => this.onOpusPacket(chunk, metadata),
      error: (error) => this.fail(`The Opus encoder failed: ${error.message}`),
    });
    this.encoder.configure(config);
    this.micTimestamp = 0;
  }

  connect() {
    setState("waiting", "connecting…");
    stats.chatUrl = chatUrl();
    this.ws = new WebSocket(stats.chatUrl);
    this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => setState("waiting", "waiting for Moshi…");
    this.ws.onmessage = (event) => this.onMessage(new Uint8Array(event.data));
    this.ws.onclose = (event) => this.onClose(event);
  }

  onMessage(message) {
    if (message.length === 0) return;
    const payload = message.subarray(1);
    switch (message[0]) {
      case KIND.handshake:
        this.handshake = true;
        setState("live", "connected: talk to Moshi");
        break;
      case KIND.audio:
        stats.receivedAudioMessages++;
        this.onServerAudio(payload);
        break;
      case KIND.text: {
        const piece = new TextDecoder().decode(payload);
        stats.text += piece;
        $("text").textContent = stats.text;
        $("text").scrollTop = $("text").scrollHeight;
        break;
      }
      case KIND.metadata:
        this.onMetadata(JSON.parse(new TextDecoder().decode(payload)));
        break;
      case KIND.error:
        this.serverError = new TextDecoder().decode(payload);
        break;
      default: // ping, control: nothing to do
    }
  }

  onMetadata(data) {
    if (data.seed !== undefined) $("seed").textContent = String(data.seed);
    if (data.frame_ms !== undefined) stats.frameSeconds = data.frame_ms / 1000;
    if (data.lag) {
      stats.droppedByServer = data.lag.total_dropped;
      this.lastLagAt = performance.now();
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
    this.send(concat([new Uint8Array([KIND.audio]), ...pages]));
    stats.sentSeconds += seconds;
  }

  send(bytes) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(bytes);
      stats.sentMessages++;
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
      output: (audio) => this.onDecodedAudio(audio),
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

  onDecodedAudio(audio) {
    const samples = new Float32Array(audio.numberOfFrames);
    audio.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
    stats.receivedSeconds += audio.numberOfFrames / audio.sampleRate;
    this.player.port.postMessage({ samples, rate: audio.sampleRate }, [samples.buffer]);
    audio.close();
  }

  showStats() {
    const context = this.context;
    const skippedSeconds = stats.droppedByServer * stats.frameSeconds;
    if (this.handshake && stats.receivedSeconds > 0) {
      // Mic audio still on its way through the server, plus what waits in the player.
      const inFlight = Math.max(0, stats.sentSeconds - stats.receivedSeconds - skippedSeconds);
      const output = (context.outputLatency || 0) + (context.baseLatency || 0);
      stats.latencyMs = Math.round(1000 * (inFlight + stats.bufferedSeconds + output));
      $("latency").textContent = `${stats.latencyMs} ms`;
    }
    const behind = performance.now() - this.lastLagAt < LAG_MEMORY_MS;
    const keepsUp = $("keeps-up");
    if (this.handshake) {
      keepsUp.textContent = behind
        ? `falling behind: ${skippedSeconds.toFixed(2)} s of your voice skipped`
        : "keeps up";
      keepsUp.className = behind ? "behind" : "good";
      stats.keepsUp = !behind;
    }
    $("mic").textContent = stats.micSoundSamples > 0 ? "on (echo cancellation)" : "silent";
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
      text = "Moshi is busy talking with someone else (one conversation at a time). Try again later.";
    } else if (this.serverError) {
      text = `The server closed the connection: ${this.serverError}`;
    } else if (wasLive) {
      text = "The connection to Moshi was closed. Press Start to talk again.";
    } else {
      text = `Could not reach Moshi's server at ${location.host} (code ${event.code}). Is it running?`;
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
      setButton(false);
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

function playerStats(data) {
  return {
    playedSoundSamples: data.soundSamples,
    playedSamples: data.playedSamples,
    underruns: data.underruns,
    bufferedSeconds: data.bufferedSeconds,
  };
}

function microphoneProblem(error) {
  switch (error && error.name) {
    case "NotAllowedError":
    case "SecurityError":
      return (
        "Microphone access was denied. Allow the microphone for this site (the icon in the " +
        "address bar, or the browser's site settings) and press Start again."
      );
    case "NotFoundError":
    case "OverconstrainedError":
      return "No microphone was found. Plug one in and press Start again.";
    case "NotReadableError":
      return "The microphone is in use by another application or cannot be opened.";
    default:
      return `Cannot open the microphone: ${error && error.message}`;
  }
}

function setButton(running) {
  const button = $("start");
  button.textContent = running ? "Stop" : "Start";
  button.classList.toggle("stop", running);
  for (const id of ["voice", "role", "examples"]) $(id).disabled = running; // set at connect
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
  setButton(true);
  try {
    await session.start();
  } catch (error) {
    const failed = session;
    if (failed) failed.stop(false);
    showMessage(error.message);
    setState("closed", "not connected");
  }
}

$("start").addEventListener("click", toggle);
loadPersona();
