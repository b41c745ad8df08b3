// The page: microphone -> Opus (WebCodecs) -> Ogg -> websocket; websocket -> Ogg -> Opus
// decoder -> AudioWorklet player. Kyutai's chat protocol, see moshi_mlx/web/protocol.py.
import { $, StartStop, VoiceLink, VoiceSession, statusDisplay } from "./voice-link.js";

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

// PersonaPlex: what the server lets us choose (GET /api/persona); null for Moshi.
let persona = null;

const display = statusDisplay(stats);
const { setState } = display;

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
      response = await fetch(`/api/persona${location.search}`);
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

class ChatSession extends VoiceSession {
  constructor() {
    super(stats, display);
    this.lastLagAt = -Infinity;
  }

  async start() {
    this.link = new VoiceLink(stats, {
      onPages: (bytes, seconds) => {
        this.send(bytes);
        stats.sentSeconds += seconds;
      },
      onPlayer: (data) => Object.assign(stats, playerStats(data)),
      onError: (text) => this.fail(text),
      microphoneProblem,
    });
    setState("waiting", "asking for the microphone…");
    await this.link.open();
    stats.chatUrl = chatUrl();
    this.connect(stats.chatUrl, "waiting for Moshi…");
    this.timer = setInterval(() => this.showStats(), 250);
  }

  onLive() {
    setState("live", "connected: talk to Moshi");
  }

  onText(piece) {
    stats.text += piece;
    $("text").textContent = stats.text;
    $("text").scrollTop = $("text").scrollHeight;
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

  closeText(wasLive, code) {
    if (this.serverError && this.serverError.startsWith("busy")) {
      return "Moshi is busy talking with someone else (one conversation at a time). Try again later.";
    }
    if (this.serverError) return `The server closed the connection: ${this.serverError}`;
    if (wasLive) return "The connection to Moshi was closed. Press Start to talk again.";
    return `Could not reach Moshi's server at ${location.host} (code ${code}). Is it running?`;
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

const startStop = new StartStop({
  stats,
  display,
  missing: MISSING,
  makeSession: () => new ChatSession(),
  showRunning: setButton,
});

$("start").addEventListener("click", () => startStop.toggle());
loadPersona();
