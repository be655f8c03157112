//! Line charts as standalone SVG: enough for a loss curve (several series, a dashed reference
//! level, axes with round ticks, a legend), no dependencies.

use std::fmt::Write as _;

/// One line of a [`Chart`].
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// SVG colour.
    pub color: String,
    /// `(x, y)` points in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Draw a dot at each point as well as the line.
    pub markers: bool,
}

impl Series {
    /// A line without markers.
    pub fn new(name: &str, color: &str, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            color: color.into(),
            points,
            markers: false,
        }
    }

    /// The same series with a dot at every point.
    pub fn with_markers(mut self) -> Self {
        self.markers = true;
        self
    }
}

/// A line chart.
#[derive(Clone, Debug)]
pub struct Chart {
    /// Title above the plot.
    pub title: String,
    /// Label of the horizontal axis.
    pub x_label: String,
    /// Label of the vertical axis.
    pub y_label: String,
    /// The lines, drawn in order.
    pub series: Vec<Series>,
    /// A horizontal reference level and its legend text, drawn dashed.
    pub baseline: Option<(f64, String)>,
}

/// The trailing moving average of `points` over `window` points.
pub fn moving_average(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= window {
                sum -= points[i - window].1;
            }
            (x, sum / (i + 1).min(window) as f64)
        })
        .collect()
}

/// About `target` round tick values (1, 2 or 5 × 10^k apart) covering `[lo, hi]`.
pub fn ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    if hi <= lo || !lo.is_finite() || !hi.is_finite() {
        return vec![lo];
    }
    let raw = (hi - lo) / target.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

/// A tick label without trailing noise.
fn label(v: f64) -> String {
    if v == v.round() && v.abs() < 1e9 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Escapes text for SVG.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl Chart {
    /// The chart as an SVG document (800 × 480).
    pub fn to_svg(&self) -> String {
        let (w, h) = (800.0, 480.0);
        let (left, right, top, bottom) = (70.0, 20.0, 40.0, 60.0);
        let (pw, ph) = (w - left - right, h - top - bottom);
        let all = self.series.iter().flat_map(|s| s.points.iter().copied());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for (x, y) in all.filter(|(x, y)| x.is_finite() && y.is_finite()) {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if let Some((b, _)) = &self.baseline {
            (y0, y1) = (y0.min(*b), y1.max(*b));
        }
        if x0 > x1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if x1 == x0 {
            x1 = x0 + 1.0;
        }
        let pad = ((y1 - y0) * 0.05).max(1e-6);
        (y0, y1) = (
            (y0 - pad).max(if y0 >= 0.0 { 0.0 } else { f64::MIN }),
            y1 + pad,
        );
        let sx = |x: f64| left + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| top + (1.0 - (y - y0) / (y1 - y0)) * ph;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
            w / 2.0,
            escape(&self.title)
        );
        // Grid and tick labels.
        for t in ticks(x0, x1, 8) {
            let x = sx(t);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                top + ph,
                top + ph + 16.0,
                label(t)
            );
        }
        for t in ticks(y0, y1, 6) {
            let y = sy(t);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                left + pw,
                left - 6.0,
                y + 4.0,
                label(t)
            );
        }
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            left + pw / 2.0,
            h - 18.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
            top + ph / 2.0,
            top + ph / 2.0,
            escape(&self.y_label)
        );
        // Legend entries: (colour, dashed, text).
        let mut legend: Vec<(String, bool, String)> = Vec::new();
        if let Some((b, name)) = &self.baseline {
            let y = sy(*b);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#888" stroke-dasharray="6 4"/>"##,
                left + pw
            );
            legend.push(("#888".into(), true, format!("{name} ({})", label(*b))));
        }
        for series in &self.series {
            let pts: Vec<String> = series
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                .collect();
            if pts.is_empty() {
                continue;
            }
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                series.color,
                pts.join(" ")
            );
            if series.markers {
                for p in &pts {
                    let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{x}" cy="{y}" r="3" fill="{}"/>"#,
                        series.color
                    );
                }
            }
            legend.push((series.color.clone(), false, series.name.clone()));
        }
        // The legend sits top right on a light panel, over anything drawn there.
        if !legend.is_empty() {
            let _ = writeln!(
                s,
                r##"<rect x="{:.1}" y="{:.1}" width="296" height="{:.1}" fill="white" fill-opacity="0.85" stroke="#ccc"/>"##,
                left + pw - 306.0,
                top + 4.0,
                16.0 * legend.len() as f64 + 4.0
            );
        }
        for (i, (color, dashed, text)) in legend.iter().enumerate() {
            let y = top + 14.0 + 16.0 * i as f64;
            let x = left + pw - 300.0;
            let dash = if *dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            };
            let _ = writeln!(
                s,
                r#"<line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
                x + 24.0,
                x + 30.0,
                y + 4.0,
                escape(text)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}
