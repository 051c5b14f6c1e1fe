"""A self-contained browser page for the Pipecat demo that needs no network at all.

Pipecat's prebuilt UI (served at ``/client/``) manages the microphone through Daily's media
library, which its page downloads from Daily's CDN at connect time; with no internet it cannot
connect. This page talks to the same bot over the same SmallWebRTC transport using only the
browser's own ``RTCPeerConnection``: type a message, hear the reply. It loads nothing from
elsewhere, so it works on an offline machine (and in CI).

Protocol, as the prebuilt UI does it: ``POST /start`` -> ``POST /sessions/{id}/api/offer`` with the
SDP offer (ICE gathered first), then RTVI messages over a data channel: ``client-ready`` in,
``bot-ready`` back, ``send-text`` for each typed turn, ``bot-tts-text`` for each spoken sentence.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Qwen3-TTS demo agent</title>
<style>
  body { font: 15px/1.45 system-ui, sans-serif; margin: 0; background: #f4f5f7; color: #1d2330; }
  header { display: flex; align-items: center; gap: 12px; padding: 12px 20px; background: #fff;
           border-bottom: 1px solid #dde1e7; }
  header h1 { font-size: 17px; margin: 0; flex: 1; }
  #status { font: 600 12px monospace; padding: 4px 10px; border-radius: 12px; background: #e4e7ec; }
  #status.connected { background: #c9f0d8; color: #0b6b34; }
  #status.error { background: #fbd5d5; color: #9b1c1c; }
  main { display: grid; grid-template-columns: 1fr 260px; gap: 16px; padding: 16px 20px; }
  section { background: #fff; border: 1px solid #dde1e7; border-radius: 10px; padding: 14px; }
  #log { height: 360px; overflow-y: auto; display: flex; flex-direction: column; gap: 8px; }
  .msg { max-width: 80%; padding: 8px 12px; border-radius: 12px; }
  .user { align-self: flex-end; background: #2563eb; color: #fff; }
  .bot { align-self: flex-start; background: #eef0f4; }
  .note { align-self: center; color: #6b7280; font-size: 13px; }
  form { display: flex; gap: 8px; margin-top: 12px; }
  input[type=text] { flex: 1; padding: 9px 12px; border: 1px solid #c5cad3; border-radius: 8px; }
  button { padding: 8px 16px; border: 0; border-radius: 8px; background: #16a34a; color: #fff;
           font-weight: 600; cursor: pointer; }
  button:disabled { background: #9ca3af; cursor: default; }
  dl { display: grid; grid-template-columns: auto 1fr; gap: 6px 10px; margin: 0; font-size: 13px; }
  dt { color: #6b7280; } dd { margin: 0; font-family: monospace; text-align: right; }
  #meter { height: 10px; background: #e4e7ec; border-radius: 5px; overflow: hidden; margin: 12px 0 4px; }
  #meter div { height: 100%; width: 0; background: #16a34a; transition: width 0.1s; }
  h2 { font-size: 13px; text-transform: uppercase; letter-spacing: 0.04em; color: #6b7280; margin: 0 0 10px; }
</style>
</head>
<body>
<header>
  <h1>Qwen3-TTS demo agent <small style="font-weight:400;color:#6b7280">(offline text page)</small></h1>
  <span id="status">DISCONNECTED</span>
  <button id="connect">Connect</button>
</header>
<main>
  <section>
    <h2>Conversation</h2>
    <div id="log"><div class="msg note">Connect, then type a message: the agent speaks its reply.</div></div>
    <form id="form">
      <input id="text" type="text" placeholder="Type a message" autocomplete="off" disabled>
      <button id="send" type="submit" disabled>Send</button>
    </form>
  </section>
  <section>
    <h2>Bot audio</h2>
    <div id="meter"><div></div></div>
    <dl>
      <dt>Level</dt><dd id="level">0.000</dd>
      <dt>Peak level</dt><dd id="peak">0.000</dd>
      <dt>Audio received</dt><dd id="received">0.0 s</dd>
      <dt>Session</dt><dd id="session">-</dd>
    </dl>
    <p style="font-size:12px;color:#6b7280">The full Pipecat UI is at <a href="/client/">/client/</a>
      (it needs internet access for its media library).</p>
  </section>
</main>
<audio id="audio" autoplay></audio>
<script>
const $ = (id) => document.getElementById(id);
const state = { pc: null, dc: null, peak: 0, received: 0, nextId: 1, reply: null };
window.demoState = state;

function setStatus(text, cls) {
  $("status").textContent = text;
  $("status").className = cls || "";
}

function addMessage(kind, text) {
  const div = document.createElement("div");
  div.className = "msg " + kind;
  div.textContent = text;
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function sendRtvi(type, data) {
  state.dc.send(JSON.stringify({ label: "rtvi-ai", type, id: String(state.nextId++), data }));
}

async function postJson(url, body) {
  const response = await fetch(url, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!response.ok) throw new Error(url + ": HTTP " + response.status);
  return response.json();
}

function iceGathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") resolve();
    });
  });
}

function onMessage(event) {
  let message;
  try { message = JSON.parse(event.data); } catch { return; }
  if (message.label !== "rtvi-ai") return;
  if (message.type === "bot-ready") {
    setStatus("CONNECTED", "connected");
    $("connect").textContent = "Connected";
    $("text").disabled = false;
    $("send").disabled = false;
    $("text").focus();
  } else if (message.type === "bot-tts-text" && message.data && message.data.text) {
    // One bubble per reply: its sentences arrive one by one, each after its audio.
    if (state.reply) state.reply.textContent += " " + message.data.text;
    else state.reply = addMessage("bot", message.data.text);
  } else if (message.type === "error" && message.data) {
    addMessage("note", "error: " + message.data.error);
  }
}

async function pollAudio() {
  if (!state.pc) return;
  const stats = await state.pc.getStats();
  stats.forEach((report) => {
    if (report.type === "inbound-rtp" && report.kind === "audio") {
      const level = report.audioLevel || 0;
      state.peak = Math.max(state.peak, level);
      state.received = report.totalSamplesDuration || 0;
      $("level").textContent = level.toFixed(3);
      $("peak").textContent = state.peak.toFixed(3);
      $("received").textContent = state.received.toFixed(1) + " s";
      $("meter").firstElementChild.style.width = Math.min(100, level * 300) + "%";
    }
  });
}

async function connect() {
  $("connect").disabled = true;
  setStatus("CONNECTING");
  try {
    const pc = new RTCPeerConnection();
    state.pc = pc;
    pc.addTransceiver("audio", { direction: "sendrecv" });
    pc.addTransceiver("video", { direction: "sendrecv" });
    const dc = pc.createDataChannel("rtvi", { ordered: true });
    state.dc = dc;
    dc.onopen = () => sendRtvi("client-ready", { version: "1.0.0", about: { library: "demo_agent text page" } });
    dc.onmessage = onMessage;
    pc.ontrack = (event) => {
      if (event.track.kind === "audio") $("audio").srcObject = new MediaStream([event.track]);
    };
    pc.onconnectionstatechange = () => {
      if (["failed", "closed", "disconnected"].includes(pc.connectionState)) {
        setStatus(pc.connectionState.toUpperCase(), "error");
        $("text").disabled = true;
        $("send").disabled = true;
      }
    };
    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc);
    const session = await postJson("/start", { transport: "webrtc" });
    $("session").textContent = session.sessionId.slice(0, 8);
    const answer = await postJson("/sessions/" + session.sessionId + "/api/offer",
      { sdp: pc.localDescription.sdp, type: pc.localDescription.type });
    await pc.setRemoteDescription({ sdp: answer.sdp, type: answer.type });
    setInterval(pollAudio, 200);
  } catch (error) {
    setStatus("ERROR", "error");
    addMessage("note", String(error));
    $("connect").disabled = false;
  }
}

$("connect").onclick = connect;
$("form").onsubmit = (event) => {
  event.preventDefault();
  const text = $("text").value.trim();
  if (!text || !state.dc || state.dc.readyState !== "open") return;
  addMessage("user", text);
  state.reply = null;
  sendRtvi("send-text", { content: text, options: { run_immediately: true, audio_response: true } });
  $("text").value = "";
};
</script>
</body>
</html>
"""
