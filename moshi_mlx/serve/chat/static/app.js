// The page: microphone -> Opus (WebCodecs) -> Ogg -> websocket; websocket -> Ogg -> Opus
// decoder -> AudioWorklet player. Kyutai's chat protocol, see moshi_mlx/web/protocol.py.
import { $, KIND, VoiceLink, missingFeature, statusDisplay } from "./voice-link.js";

const LAG_MEMORY_MS = 5000; // "falling behind" stays on this long after the server drops audio

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

const { setState, showMessage } = statusDisplay(stats);

const MISSING = {
  insecure:
    "This page is not a secure context, so the browser withholds the microphone. Open it as " +
    "http://localhost:PORT on the computer running Moshi, or start the server with --ssl DIR " +
    "and use https:// from other devices.",
  noWebCodecs:
    "This browser lacks WebCodecs audio (AudioEncoder/AudioDecoder), which the page uses for " +
    "Opus: use Chrome or Edge 94+, Firefox 130+ or Safari 26+.",
};

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

class Session {
  constructor() {
    this.closedByUser = false;
    this.handshake = false;
    this.lastLagAt = -Infinity;
  }

  async start() {
    this.link = new VoiceLink({
      onMicFrame: (soundSamples) => {
        stats.micFrames++;
        stats.micSoundSamples = soundSamples;
      },
      onPages: (bytes, seconds) => {
        this.send(bytes);
        stats.sentSeconds += seconds;
      },
      onPlayer: (data) => Object.assign(stats, playerStats(data)),
      onDecoded: (seconds) => {
        stats.receivedSeconds += seconds;
      },
      onError: (text) => this.fail(text),
      microphoneProblem,
    });
    setState("waiting", "asking for the microphone…");
    await this.link.open();
    this.connect();
    this.timer = setInterval(() => this.showStats(), 250);
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
        this.link.sending = true;
        setState("live", "connected: talk to Moshi");
        break;
      case KIND.audio:
        stats.receivedAudioMessages++;
        this.link.play(payload);
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

  send(bytes) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(bytes);
      stats.sentMessages++;
    }
  }

  showStats() {
    const context = this.link.context;
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
    if (this.link) this.link.close();
    if (session === this) {
      session = null;
      setButton(false);
    }
    if (byUser) setState("idle", "stopped");
  }
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
  const missing = missingFeature(MISSING);
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
