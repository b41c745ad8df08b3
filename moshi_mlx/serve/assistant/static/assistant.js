// The assistant's page: microphone (the browser's echo cancellation on) -> Opus (WebCodecs)
// -> Ogg -> websocket /api/assistant; its answer's Ogg Opus -> decoder -> AudioWorklet
// player; both sides' words as they come. Kyutai's chat protocol (first byte = kind), with
// the assistant's events as 0x04 metadata: see moshi_mlx/serve/assistant/messages.py.
import { $, StartStop, VoiceLink, VoiceSession, statusDisplay } from "./voice-link.js";

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


const display = statusDisplay(stats);
const { setState, showMessage } = display;

const MISSING = {
  insecure:
    "This page is not a secure context, so the browser withholds the microphone. Open it as " +
    "http://localhost:PORT on the computer running the server.",
  noWebCodecs:
    "This browser lacks WebCodecs audio (Opus): use Chrome or Edge 94+, Firefox 130+ or Safari 26+.",
};

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

// --- the conversation's connection ---
class AssistantVoiceSession extends VoiceSession {
  constructor() {
    super(stats, display);
  }

  async start() {
    this.link = new VoiceLink(stats, {
      onPages: (bytes, seconds) => {
        if (this.ws && this.ws.readyState === WebSocket.OPEN) {
          this.ws.send(bytes);
          stats.sentSeconds += seconds;
        }
      },
      onPlayer: (data) => {
        stats.playedSoundSamples = data.soundSamples;
        stats.underruns = data.underruns;
      },
      onError: (text) => this.fail(text),
      microphoneProblem: (error) =>
        `Cannot open the microphone: ${error && (error.name || error.message)}`,
    });
    setState("waiting", "asking for the microphone…");
    await this.link.open();
    const protocol = location.protocol === "https:" ? "wss:" : "ws:";
    // The page's own query (?auth_id=KEY) goes to the server.
    const url = `${protocol}//${location.host}/api/assistant${location.search}`;
    this.connect(url, "waiting for the assistant…");
    this.timer = setInterval(() => {
      $("mic").textContent = stats.micSoundSamples > 0 ? "on (echo cancellation)" : "silent";
    }, 250);
  }

  onLive() {
    setState("live", "connected: talk to the assistant");
  }

  onText(text) {
    onWords("assistant", text.trim());
  }

  onMetadata(data) {
    onEvent(data);
  }

  closeText(wasLive, code) {
    if (this.serverError && this.serverError.startsWith("busy")) {
      return "The assistant is talking with someone else (one conversation at a time). Try again later.";
    }
    if (this.serverError) return `The server closed the connection: ${this.serverError}`;
    if (wasLive) return "The connection was closed. Press Start to talk again.";
    return `Could not reach the assistant at ${location.host} (code ${code}). Is the server running with --stt, --tts and --llm?`;
  }
}

const startStop = new StartStop({
  stats,
  display,
  missing: MISSING,
  makeSession: () => new AssistantVoiceSession(),
  showRunning: (running) => {
    $("start").textContent = running ? "Stop" : "Start";
    $("start").classList.toggle("stop", running);
  },
});

$("start").addEventListener("click", () => startStop.toggle());
