//! Line charts (a loss curve: several series, a dashed reference level, a legend) drawn with
//! [plotters] and written as SVG and as PNG.
//!
//! Text is laid out and, in the PNG, rasterised with the DejaVu Sans subset bundled in
//! `assets/fonts/` (through plotters' `ab_glyph` feature), so no system font library is needed;
//! the SVG names `sans-serif` and leaves the glyphs to the viewer. The PNG bitmap is encoded
//! with the `png` crate (plotters' own encoder would bring in the `image` crate).

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

/// The font every chart's text uses, under the family name `sans-serif`.
const FONT: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/assets/fonts/DejaVuSans-Latin1.ttf"
));

/// Size of both images, pixels.
const SIZE: (u32, u32) = (960, 540);

/// One line of a [`Chart`].
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Line colour.
    pub color: RGBColor,
    /// `(x, y)` points in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Draw a dot at each point as well as the line.
    pub markers: bool,
}

impl Series {
    /// A line without markers; `color` is `0xRRGGBB`.
    pub fn new(name: &str, color: u32, points: Vec<(f64, f64)>) -> Self {
        let [_, r, g, b] = color.to_be_bytes();
        Self {
            name: name.into(),
            color: RGBColor(r, g, b),
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

/// Makes the bundled font plotters' `sans-serif` (once per process).
fn register_font() -> Result<(), String> {
    static REGISTER: Once = Once::new();
    let mut result = Ok(());
    REGISTER.call_once(|| {
        result = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the bundled font (assets/fonts) does not parse".to_string());
    });
    result
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

impl Chart {
    /// The plotted ranges: every finite point and the baseline, with 5 % of head room on y
    /// (not below 0 when nothing is negative).
    fn ranges(&self) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
        let all = self.series.iter().flat_map(|s| s.points.iter().copied());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for (x, y) in all.filter(|(x, y)| x.is_finite() && y.is_finite()) {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if let Some((b, _)) = &self.baseline {
            (y0, y1) = (y0.min(*b), y1.max(*b));
        }
        if x0 > x1 || y0 > y1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if x1 == x0 {
            x1 = x0 + 1.0;
        }
        let pad = ((y1 - y0) * 0.05).max(1e-6);
        let floor = if y0 >= 0.0 { 0.0 } else { f64::MIN };
        (x0..x1, (y0 - pad).max(floor)..y1 + pad)
    }

    /// Draws the chart onto `root` (any plotters backend).
    pub fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<(), String> {
        let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing the chart: {e}");
        register_font()?;
        root.fill(&WHITE).map_err(err)?;
        let (xs, ys) = self.ranges();
        let (x0, x1) = (xs.start, xs.end);
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(xs, ys)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(self.x_label.as_str())
            .y_desc(self.y_label.as_str())
            // Whole steps on short runs: one label per step up to 10.
            .x_labels(((x1 - x0).round() as usize + 1).clamp(2, 10))
            .y_labels(8)
            .x_label_formatter(&|v| label(*v))
            .y_label_formatter(&|v| label(*v))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 15))
            .bold_line_style(RGBColor(0xe0, 0xe0, 0xe0))
            .light_line_style(RGBColor(0xf4, 0xf4, 0xf4))
            .draw()
            .map_err(err)?;
        if let Some((level, name)) = &self.baseline {
            let grey = RGBColor(0x80, 0x80, 0x80);
            chart
                .draw_series(DashedLineSeries::new(
                    [(x0, *level), (x1, *level)],
                    8,
                    5,
                    grey.stroke_width(2),
                ))
                .map_err(err)?
                .label(format!("{name} ({})", label(*level)))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 24, y)], grey.stroke_width(2))
                });
        }
        for series in &self.series {
            let color = series.color;
            let points: Vec<(f64, f64)> = series
                .points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect();
            if points.is_empty() {
                continue;
            }
            if series.markers {
                chart
                    .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(err)?;
            }
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(err)?
                .label(series.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 24, y)], color.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(0xbb, 0xbb, 0xbb))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)
    }

    /// The chart as an SVG document.
    pub fn to_svg(&self) -> Result<String, String> {
        let mut svg = String::new();
        self.draw(SVGBackend::with_string(&mut svg, SIZE).into_drawing_area())?;
        Ok(svg)
    }

    /// The chart as an RGB image, `SIZE.0 × SIZE.1` pixels, row-major.
    pub fn to_rgb(&self) -> Result<Vec<u8>, String> {
        let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
        self.draw(BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area())?;
        Ok(rgb)
    }

    /// Writes the chart to `svg` and to `png`.
    pub fn write(&self, svg: &Path, png: &Path) -> Result<(), String> {
        std::fs::write(svg, self.to_svg()?)
            .map_err(|e| format!("writing {}: {e}", svg.display()))?;
        let rgb = self.to_rgb()?;
        let io = |e: std::io::Error| format!("writing {}: {e}", png.display());
        let file = std::io::BufWriter::new(std::fs::File::create(png).map_err(io)?);
        let mut encoder = png::Encoder::new(file, SIZE.0, SIZE.1);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let encoding = |e: png::EncodingError| format!("writing {}: {e}", png.display());
        let mut writer = encoder.write_header().map_err(encoding)?;
        writer.write_image_data(&rgb).map_err(encoding)?;
        writer.finish().map_err(encoding)
    }
}
