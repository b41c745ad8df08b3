// Ogg pages around Opus packets (RFC 3533, RFC 7845), both ways, for the chat protocol:
// each direction of a connection is one Ogg stream that starts with its OpusHead page.

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let r = i << 24;
    for (let bit = 0; bit < 8; bit++) {
      r = r & 0x80000000 ? (r << 1) ^ 0x04c11db7 : r << 1;
    }
    table[i] = r >>> 0;
  }
  return table;
})();

function oggCrc(bytes) {
  let crc = 0;
  for (let i = 0; i < bytes.length; i++) {
    crc = ((crc << 8) ^ CRC_TABLE[((crc >>> 24) ^ bytes[i]) & 0xff]) >>> 0;
  }
  return crc;
}

const ascii = (text) => Uint8Array.from(text, (c) => c.charCodeAt(0));

/** The 19-byte OpusHead of a mono stream (pre-skip in 48 kHz samples). */
export function opusHead(inputSampleRate, preSkip) {
  const head = new Uint8Array(19);
  const view = new DataView(head.buffer);
  head.set(ascii("OpusHead"), 0);
  head[8] = 1; // version
  head[9] = 1; // channels
  view.setUint16(10, preSkip, true);
  view.setUint32(12, inputSampleRate, true);
  view.setInt16(16, 0, true); // output gain
  head[18] = 0; // channel mapping family: mono/stereo
  return head;
}

function opusTags(vendor) {
  const vendorBytes = new TextEncoder().encode(vendor);
  const tags = new Uint8Array(8 + 4 + vendorBytes.length + 4);
  const view = new DataView(tags.buffer);
  tags.set(ascii("OpusTags"), 0);
  view.setUint32(8, vendorBytes.length, true);
  tags.set(vendorBytes, 12);
  view.setUint32(12 + vendorBytes.length, 0, true); // no user comments
  return tags;
}

/** Writes Opus packets as Ogg pages, one packet per page. */
export class OggOpusWriter {
  constructor(head) {
    this.serial = (Math.random() * 0xffffffff) >>> 0;
    this.sequence = 0;
    this.granule = 0; // 48 kHz samples, as Ogg Opus counts them
    this.head = head;
  }

  /** The OpusHead and OpusTags pages that open the stream. */
  headers() {
    const head = this.page(this.head, 0x02);
    const tags = this.page(opusTags("moshi_mlx web page"), 0x00);
    return concat([head, tags]);
  }

  /** One page holding `packet`, which lasts `samples48k` samples at 48 kHz. */
  packet(packet, samples48k) {
    this.granule += samples48k;
    return this.page(packet, 0x00);
  }

  page(packet, headerType) {
    const lacing = [];
    let left = packet.length;
    while (left >= 255) {
      lacing.push(255);
      left -= 255;
    }
    lacing.push(left); // a 0 ends a packet whose length is a multiple of 255
    if (lacing.length > 255) throw new Error("Opus packet too large for one Ogg page");
    const page = new Uint8Array(27 + lacing.length + packet.length);
    const view = new DataView(page.buffer);
    page.set(ascii("OggS"), 0);
    page[4] = 0; // version
    page[5] = headerType;
    view.setUint32(6, this.granule % 0x100000000, true);
    view.setUint32(10, Math.floor(this.granule / 0x100000000), true);
    view.setUint32(14, this.serial, true);
    view.setUint32(18, this.sequence++, true);
    page[26] = lacing.length;
    page.set(lacing, 27);
    page.set(packet, 27 + lacing.length);
    view.setUint32(22, oggCrc(page), true);
    return page;
  }
}

/** Collects Ogg bytes (split anyhow) and returns the packets of the complete pages. */
export class OggPacketReader {
  constructor() {
    this.buffer = new Uint8Array(0);
    this.partial = []; // pieces of a packet that continues on the next page
  }

  /** Returns [{packet, granule}], granule being the page's (end) position or -1. */
  push(bytes) {
    this.buffer = concat([this.buffer, bytes]);
    const packets = [];
    let offset = 0;
    while (this.buffer.length - offset >= 27) {
      const b = this.buffer;
      if (b[offset] !== 0x4f || b[offset + 1] !== 0x67 || b[offset + 2] !== 0x67 || b[offset + 3] !== 0x53) {
        throw new Error("audio from the server is not an Ogg stream");
      }
      const segments = b[offset + 26];
      if (this.buffer.length - offset < 27 + segments) break;
      const lacing = b.subarray(offset + 27, offset + 27 + segments);
      const bodySize = lacing.reduce((sum, v) => sum + v, 0);
      const end = offset + 27 + segments + bodySize;
      if (this.buffer.length < end) break;
      const view = new DataView(b.buffer, b.byteOffset + offset);
      const granuleLow = view.getUint32(6, true);
      const granuleHigh = view.getInt32(10, true);
      const granule = granuleHigh === -1 ? -1 : granuleHigh * 0x100000000 + granuleLow;
      let position = offset + 27 + segments;
      let start = position;
      for (const value of lacing) {
        position += value;
        if (value < 255) {
          this.partial.push(b.slice(start, position));
          packets.push({ packet: concat(this.partial), granule });
          this.partial = [];
          start = position;
        }
      }
      if (start < position) this.partial.push(b.slice(start, position));
      offset = end;
    }
    this.buffer = this.buffer.slice(offset);
    return packets;
  }
}

export function concat(arrays) {
  const total = arrays.reduce((sum, a) => sum + a.length, 0);
  const out = new Uint8Array(total);
  let offset = 0;
  for (const a of arrays) {
    out.set(a, offset);
    offset += a.length;
  }
  return out;
}
